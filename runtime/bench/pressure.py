"""Memory pressure for ``zipmoe bench --pressure SIZE``: the paper's experiment with host memory
occupied (32 GB of it), so that the page cache cannot hold the weights an engine reads through it.

Before the first engine starts, bench starts one ballast process that maps anonymous memory until
only SIZE of the host's memory stays available, and writes a byte into every page of it (a page
never written takes no memory). Without swap such memory cannot be reclaimed, so the page cache
and every engine share what is left; with swap the kernel may page the ballast out, which the
record says (``swap_bytes``). The ballast tries ``mlock`` as well and records whether it held.
It lives outside every engine's memory cgroup (it belongs to bench), ends with bench (it reads its
standard input until bench closes it or dies) and is killed at the end. Whether it was still alive
when the last engine finished is recorded: the kernel's OOM killer picks the largest process
first, so a SIZE too small for the engines may kill the ballast rather than an engine, and the run
would then not have been under pressure; bench says so in one line.
"""

from __future__ import annotations

import subprocess
import sys
import time

from zipmoe.errors import UsageError
from zipmoe.units import format_size

# the ballast: map N bytes, write a byte per page, try mlock, say "ready", wait for EOF on stdin
_BALLAST = r"""
import ctypes, mmap, sys
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
page = mmap.PAGESIZE
chunk = page << 14
for off in range(0, n, chunk):
    end = min(n, off + chunk)
    m[off:end:page] = b"\x01" * len(range(off, end, page))
locked = False
try:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_char * n).from_buffer(m)
    locked = libc.mlock(ctypes.addressof(buf), ctypes.c_size_t(n)) == 0
    del buf
except Exception:
    pass
print("ready", int(locked), flush=True)
sys.stdin.read()
"""

MIN_LEAVE = 256 << 20


def check_leave(leave: int, available: int | None = None) -> int:
    """The bytes ``--pressure leave`` would occupy now; one line when it cannot."""
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if leave < MIN_LEAVE:
        raise UsageError(f"--pressure {format_size(leave)}: leave at least {format_size(MIN_LEAVE)} for the engines")
    if available - leave <= 0:
        raise UsageError(f"--pressure {format_size(leave)}: only {format_size(available)} of host memory is "
                         f"available now, so nothing would be occupied; give less than that")
    return available - leave


class Ballast:
    """``with Ballast(leave_bytes) as b:`` occupies the host's memory but ``leave_bytes``;
    ``b.record`` is what the bench document keeps (``doc["pressure"]``)."""

    def __init__(self, leave_bytes: int, log=print) -> None:
        self.leave = int(leave_bytes)
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.record: dict = {}

    def __enter__(self) -> "Ballast":
        import psutil

        vm = psutil.virtual_memory()
        occupy = check_leave(self.leave, int(vm.available))
        self.log(f"memory pressure: occupying {format_size(occupy)} of host memory so that {format_size(self.leave)} stays available")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", _BALLAST, str(occupy)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip().splitlines()
            self._kill()
            raise UsageError(f"--pressure {format_size(self.leave)}: the process occupying {format_size(occupy)} "
                             f"did not start ({err[-1] if err else 'no output'})")
        after = psutil.virtual_memory()
        self.record = {"leave_bytes": self.leave, "occupied_bytes": occupy, "available_before_bytes": int(vm.available),
                       "available_after_bytes": int(after.available), "total_bytes": int(vm.total),
                       "swap_bytes": int(psutil.swap_memory().total), "mlocked": line.split()[-1] == "1",
                       "occupy_s": round(time.perf_counter() - t0, 2), "pid": self.proc.pid}
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _kill(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.record["held_to_the_end"] = self.alive()
            if not self.record["held_to_the_end"]:
                self.record["ended_with"] = self.proc.returncode
                self.log(f"warning: the memory-pressure ballast ended early (status {self.proc.returncode}: the OOM killer?), "
                         "so the later runs were not under pressure")
        self._kill()
