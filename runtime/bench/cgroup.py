"""Memory cgroups for `zipmoe bench`: the operating system enforces the budget on every engine.

Each engine runs in its own child process inside a fresh memory cgroup, a child of the cgroup
this process is in. Both kinds count the page cache, so an engine cannot quietly serve the
model from cached file pages:

- cgroup v2 (``cgroup2`` mount, ``memory`` in the controllers): ``memory.max``, peak from
  ``memory.peak``, OOM kills from ``memory.events``. The parent must have ``memory`` in its
  ``cgroup.subtree_control``; that can only be switched on when the parent holds no processes
  itself (the "no internal processes" rule: the write fails with EBUSY), so inside a container
  or VM agent whose own cgroup holds the shell it fails. By default :func:`detect` says so and
  names ``--cgroup-move-to-leaf``. With ``move_to_leaf=True`` (opt-in, root only) it does what
  container runtimes and systemd do: create the leaf child ``<own>/zipmoe-leaf``, move every
  process of the own cgroup into it (this process, its parent shell and their siblings),
  enable ``memory`` for children and record that in ``CgroupSupport.notes``. The processes stay
  in the leaf afterwards, and the own cgroup can take no processes directly any more.
- cgroup v1 (a ``cgroup`` mount with the ``memory`` option): ``memory.limit_in_bytes``, peak
  from ``memory.max_usage_in_bytes``, OOM kills from ``memory.oom_control``.

:func:`detect` moves no process unless ``move_to_leaf`` is true; what it may change otherwise
is the switch above (``+memory`` in the own cgroup's ``subtree_control``, where the kernel
allows it) and, with ``probe``, a test child it removes at once. :class:`MemoryCgroup` creates
a child, the engine's process joins it (``join`` writes its own pid, so it is inside before it
imports torch), and ``close`` removes it. :func:`check_page_cache_cap` is the self-test the
benchmark report records: read a file three times the limit inside a limited cgroup and see how
much of it the page cache kept.

Run ``python -m zipmoe.runtime.bench.cgroup [--no-check] [--move-to-leaf]`` for the detection
and the page-cache check as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV_CGROUP = "ZIPMOE_BENCH_CGROUP"  # the engine's process joins the cgroup folder named here
LEAF_NAME = "zipmoe-leaf"  # child of the own v2 cgroup that its processes move to (move_to_leaf)
MOVE_OPTION = "--cgroup-move-to-leaf"  # the bench option that allows the move
MOVED_NOTE = "moved "  # how the note saying that processes were moved begins (bench echoes it)


@dataclass
class CgroupSupport:
    """What :func:`detect` found. ``usable`` is the one answer that matters."""

    usable: bool
    version: int | None = None  # 1 or 2
    parent: str | None = None  # folder the child cgroups are made in
    reason: str = ""  # why not usable, or a remark
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        parts = line.split()
        if " - " not in line or len(parts) < 10:
            continue
        sep = parts.index("-")
        fstype = parts[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        out.append((parts[3], parts[4], fstype, parts[sep + 3] if len(parts) > sep + 3 else ""))
    return out


def _own_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """Own cgroup path in the v1 memory hierarchy and in the v2 hierarchy."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _join(mount_root: str, mount_point: str, path: str) -> Path:
    if mount_root != "/" and path.startswith(mount_root):
        path = path[len(mount_root):]
    return Path(mount_point) / path.lstrip("/")


def detect(mountinfo: str | None = None, proc_cgroup: str | None = None, probe: bool = True,
           move_to_leaf: bool = False) -> CgroupSupport:
    """Find where a child memory cgroup can be made. ``probe`` tries mkdir/rmdir of a test child.

    ``mountinfo`` and ``proc_cgroup`` default to this process's /proc files (tests pass text).
    ``move_to_leaf``: when cgroup v2 refuses the memory controller for children because the
    own cgroup holds processes (EBUSY), move them all into ``<own>/zipmoe-leaf`` and try again
    (see :func:`move_procs_to_leaf`); what was moved is in ``notes``. Off by default: then no
    process is ever moved.
    """
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
    except OSError as exc:
        return CgroupSupport(False, reason=f"cannot read /proc/self cgroup files: {exc}")
    v1_path, v2_path = _own_paths(proc_cgroup)
    notes: list[str] = []
    candidates: list[tuple[int, Path]] = []
    for root, point, fstype, opts in _mounts(mountinfo):
        if fstype == "cgroup2" and v2_path is not None:
            folder = _join(root, point, v2_path)
            parent_sub = _read(folder.parent / "cgroup.subtree_control") or ""
            if folder.name == LEAF_NAME and "memory" in parent_sub.split():
                # an earlier --cgroup-move-to-leaf made this layout: engines go beside the leaf,
                # in its parent (memory on for children, no processes of its own), not one deeper
                notes.append(f"this process is in {folder} (made by an earlier {MOVE_OPTION}); engine cgroups go beside it")
                folder = folder.parent
            ctrl = _read(folder / "cgroup.controllers")
            if ctrl is None or "memory" not in ctrl.split():
                notes.append(f"cgroup v2 at {point}: no memory controller")
                continue
            candidates.append((2, folder))
        elif fstype == "cgroup" and "memory" in opts.split(",") and v1_path is not None:
            candidates.append((1, _join(root, point, v1_path)))
    if not candidates:
        return CgroupSupport(False, reason="no memory cgroup hierarchy is mounted" + (f" ({'; '.join(notes)})" if notes else ""), notes=notes)
    candidates.sort(key=lambda c: -c[0])  # prefer v2
    reasons = []
    for version, folder in candidates:
        why = _usable(version, folder, probe, move_to_leaf, notes)
        if why is None:
            return CgroupSupport(True, version, str(folder), reason=f"cgroup v{version} memory controller at {folder}", notes=notes)
        reasons.append(f"v{version} at {folder}: {why}")
    return CgroupSupport(False, reason="; ".join(reasons), notes=notes)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _enable_memory_for_children(folder: Path) -> None:
    """Write ``+memory`` to ``folder``'s subtree_control (EBUSY while ``folder`` holds processes)."""
    (folder / "cgroup.subtree_control").write_text("+memory")


def _move_pid(procs_file: Path, pid: int) -> None:
    """Move one process into the cgroup whose ``cgroup.procs`` is ``procs_file`` (one pid a write)."""
    procs_file.write_text(str(pid))


def _pids(procs_file: Path) -> list[int] | None:
    text = _read(procs_file)
    if text is None:
        return None
    return [int(p) for p in text.split() if p.isdigit()]


def move_procs_to_leaf(folder: Path, leaf_name: str = LEAF_NAME, passes: int = 5) -> tuple[int, str | None]:
    """Move every process of the cgroup ``folder`` into its child ``leaf_name`` (made if missing).

    Returns (processes moved, None) or (processes moved before it went wrong, why). A pid that
    exited meanwhile is skipped; the list is read again up to ``passes`` times because processes
    can fork while they are moved. Processes already moved stay in the leaf when it fails.
    """
    leaf = folder / leaf_name
    try:
        leaf.mkdir(exist_ok=True)
    except OSError as exc:
        return 0, f"cannot create the leaf cgroup {leaf} ({exc.strerror})"
    moved: set[int] = set()
    for _ in range(passes):
        pids = _pids(folder / "cgroup.procs")
        if pids is None:
            return len(moved), f"cannot read {folder / 'cgroup.procs'}"
        if not pids:
            return len(moved), None
        for pid in pids:
            try:
                _move_pid(leaf / "cgroup.procs", pid)
            except OSError as exc:
                if exc.errno == errno.ESRCH:  # exited meanwhile
                    continue
                return len(moved), f"cannot move process {pid} into {leaf} ({exc.strerror or exc})"
            moved.add(pid)
    left = _pids(folder / "cgroup.procs")
    if left:
        return len(moved), f"{len(left)} processes still in {folder} after {passes} passes (they keep forking)"
    return len(moved), None


def _enable_memory(folder: Path, move_to_leaf: bool, notes: list[str] | None) -> str | None:
    """Switch the v2 memory controller on for ``folder``'s children (moving its processes into
    a leaf first when the kernel refuses with EBUSY and ``move_to_leaf``); None or why not."""
    try:
        _enable_memory_for_children(folder)
        return None
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            return f"cannot enable the memory controller for children ({exc.strerror or exc})"
        if not move_to_leaf:
            return (f"cannot enable the memory controller for children ({exc.strerror or exc}; the own cgroup holds "
                    f"processes; {MOVE_OPTION} moves them into a leaf child {LEAF_NAME}, as container runtimes do)")
    moved, err = move_procs_to_leaf(folder)
    if err is not None:
        return (f"cannot enable the memory controller for children: the own cgroup holds processes and moving them "
                f"into {folder / LEAF_NAME} failed part way ({moved} moved, they stay there): {err}")
    try:
        _enable_memory_for_children(folder)
    except OSError as exc2:
        return (f"cannot enable the memory controller for children even after moving {moved} processes into "
                f"{folder / LEAF_NAME} ({exc2.strerror or exc2})")
    if notes is not None:
        notes.append(f"{MOVED_NOTE}{moved} processes of {folder} into {folder / LEAF_NAME} so that the memory controller "
                     f"could be enabled for children (cgroup v2 no-internal-process rule)")
    return None


def _usable(version: int, folder: Path, probe: bool, move_to_leaf: bool = False, notes: list[str] | None = None) -> str | None:
    """None when a child with a memory limit can be made under ``folder``, else why not."""
    if not folder.is_dir():
        return "own cgroup folder is not visible"
    if not os.access(folder, os.W_OK):
        return "not writable (run as root, or in a container with a writable cgroup)"
    if version == 2 and "memory" not in (_read(folder / "cgroup.subtree_control") or "").split():
        why = _enable_memory(folder, move_to_leaf, notes)
        if why is not None:
            return why
    if not probe:
        return None
    test = folder / f"zipmoe-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        test.mkdir()
    except OSError as exc:
        return f"cannot create a child cgroup ({exc.strerror})"
    try:
        limit_file = test / ("memory.max" if version == 2 else "memory.limit_in_bytes")
        if not limit_file.exists():
            return "child cgroup has no memory limit file"
        try:
            limit_file.write_text(str(1 << 30))
        except OSError as exc:
            return f"cannot set a memory limit ({exc.strerror})"
    finally:
        try:
            test.rmdir()
        except OSError:
            pass
    return None


def sweep_stale(parent) -> list[str]:
    """Remove the ``zipmoe-bench-<pid>-*`` cgroups under ``parent`` that a bench killed before it
    could remove them left behind (a SIGKILL or SIGTERM skips the ``with``'s exit): those whose
    pid is gone and that hold no process (rmdir refuses one that does). Returns the names removed."""
    gone = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return gone
    for d in entries:
        pid, _, rest = d.name.removeprefix("zipmoe-bench-").partition("-")
        if not d.name.startswith("zipmoe-bench-") or not pid.isdigit() or not rest:
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its bench is still running
        except ProcessLookupError:
            pass
        except OSError:
            continue  # alive, another user's
        try:
            d.rmdir()
            gone.append(d.name)
        except OSError:
            pass
    return gone


class MemoryCgroup:
    """A child memory cgroup with a hard limit; ``with MemoryCgroup(support, limit) as cg:``.
    Making one first removes what killed benches left behind (:func:`sweep_stale`)."""

    def __init__(self, support: CgroupSupport, limit_bytes: int, name: str | None = None):
        if not support.usable or support.parent is None:
            raise RuntimeError(f"memory cgroups are not usable here: {support.reason}")
        self.version = support.version
        self.limit = int(limit_bytes)
        if name is None:
            sweep_stale(support.parent)
        self.path = Path(support.parent) / (name or f"zipmoe-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.path.mkdir()
        try:
            if self.version == 2:
                (self.path / "memory.max").write_text(str(self.limit))
                try:  # no swap: the limit is the limit
                    (self.path / "memory.swap.max").write_text("0")
                except OSError:
                    pass
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
                try:
                    (self.path / "memory.swappiness").write_text("0")
                except OSError:
                    pass
        except OSError:
            self.close()
            raise

    def env(self) -> dict:
        """Environment for the child: it joins the cgroup itself (see :func:`join_from_env`)."""
        return {ENV_CGROUP: str(self.path)}

    def pids(self) -> list[int]:
        text = _read(self.path / "cgroup.procs") or ""
        return [int(p) for p in text.split()]

    def peak(self) -> int | None:
        """Peak usage, page cache included (v2 needs kernel >= 5.19 for memory.peak)."""
        text = _read(self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
        return int(text) if text and text.isdigit() else None

    def page_cache(self) -> int | None:
        stat = _read(self.path / "memory.stat") or ""
        key = "file" if self.version == 2 else "cache"
        for line in stat.splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
        return None

    def oom_kills(self) -> int:
        if self.version == 2:
            text = _read(self.path / "memory.events") or ""
        else:
            text = _read(self.path / "memory.oom_control") or ""
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                return int(v)
        return 0

    def current_limit(self) -> int:
        """The limit now (the engine's process may have tightened it, see :func:`set_own_limit`)."""
        text = _read(self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        return int(text) if text and text.isdigit() else self.limit

    def stats(self) -> dict:
        return {
            "cgroup": str(self.path),
            "cgroup_version": self.version,
            "limit_bytes": self.current_limit(),
            "initial_limit_bytes": self.limit,
            "peak_bytes": self.peak(),
            "page_cache_bytes": self.page_cache(),
            "oom_kills": self.oom_kills(),
        }

    def close(self) -> None:
        """Remove the cgroup (waits briefly for exiting processes); never raises."""
        if not self.path.exists():
            return
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                # leftover processes (should not happen: the engine process has exited)
                for pid in self.pids():
                    try:
                        (self.path.parent / "cgroup.procs").write_text(str(pid))
                    except OSError:
                        pass
                time.sleep(0.1)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def join_from_env() -> str | None:
    """Called first thing in an engine's process: join the cgroup the parent named, if any."""
    path = os.environ.get(ENV_CGROUP)
    if not path:
        return None
    Path(path, "cgroup.procs").write_text(str(os.getpid()))
    return path


def set_own_limit(path: str, limit_bytes: int) -> bool:
    """Change the limit of the cgroup at ``path`` (the engine's own, from :func:`join_from_env`)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        f = Path(path, name)
        if f.exists():
            try:
                f.write_text(str(int(limit_bytes)))
            except OSError:
                return False
            for peak in ("memory.max_usage_in_bytes", "memory.peak"):  # restart the peak under the new limit
                try:
                    Path(path, peak).write_text("0")
                except OSError:
                    pass
            return True
    return False


def _meminfo_cached() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    return 0


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_page_cache_cap(limit_bytes: int = 512 << 20, file_bytes: int = 1536 << 20, folder: str | None = None,
                         move_to_leaf: bool = False) -> dict:
    """Read a ``file_bytes`` file inside a ``limit_bytes`` cgroup; report what the cache kept.

    Evidence recorded: the cgroup's peak usage and page cache, and the growth of the system's
    ``Cached`` (from /proc/meminfo), which includes pages charged to no cgroup at all.
    ``move_to_leaf`` is passed to :func:`detect`.
    """
    support = detect(move_to_leaf=move_to_leaf)
    result = {"limit_bytes": limit_bytes, "file_bytes": file_bytes, "support": support.to_dict()}
    if not support.usable:
        result.update(ok=False, observation=f"no cgroup: {support.reason}")
        return result
    folder_p = Path(folder or os.environ.get("TMPDIR", "/var/tmp"))
    target = folder_p / f"zipmoe-cgroup-check-{os.getpid()}.bin"
    try:
        block = os.urandom(1 << 20)
        with open(target, "wb") as f:
            for _ in range(file_bytes >> 20):
                f.write(block)
        _evict(target)
        cached_before = _meminfo_cached()
        reader = (
            "import os,sys\n"
            "fd=os.open(sys.argv[1],os.O_RDONLY); n=0\n"
            "while True:\n"
            "    b=os.read(fd,1<<20)\n"
            "    if not b: break\n"
            "    n+=len(b)\n"
            "print(n)\n"
        )
        with MemoryCgroup(support, limit_bytes) as cg:
            env = dict(os.environ, **cg.env())
            code = "from zipmoe.runtime.bench.cgroup import join_from_env; join_from_env()\n" + reader
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            cached_after = _meminfo_cached()
            stats = cg.stats()
        read = int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
        growth = cached_after - cached_before
        capped = proc.returncode == 0 and read == file_bytes and (stats["peak_bytes"] or 0) <= limit_bytes and growth < file_bytes // 2
        result.update(
            ok=capped,
            returncode=proc.returncode,
            bytes_read=read,
            seconds=round(seconds, 2),
            cgroup_peak_bytes=stats["peak_bytes"],
            cgroup_page_cache_bytes=stats["page_cache_bytes"],
            system_cached_growth_bytes=growth,
            oom_kills=stats["oom_kills"],
            observation=(
                f"cgroup v{support.version}: read {read / 2**20:.0f} MiB in a {limit_bytes / 2**20:.0f} MiB cgroup; "
                f"cgroup peak {(stats['peak_bytes'] or 0) / 2**20:.0f} MiB, its page cache at the end "
                f"{(stats['page_cache_bytes'] or 0) / 2**20:.0f} MiB, system page cache grew by {growth / 2**20:.0f} MiB"
                f" -> the page cache {'IS' if capped else 'is NOT'} capped"
            ),
        )
        return result
    finally:
        try:
            target.unlink()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unknown = [a for a in argv if a not in ("--no-check", "--move-to-leaf")]
    if unknown:
        print(f"error: unknown option {unknown[0]!r}: use --no-check and/or --move-to-leaf", file=sys.stderr)
        return 2
    move = "--move-to-leaf" in argv
    out = {"detect": detect(move_to_leaf=move).to_dict()}
    if "--no-check" not in argv:
        out["page_cache_check"] = check_page_cache_cap(move_to_leaf=move)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
