"""Cold runs for `zipmoe bench`: empty the page cache before a run, and measure the disk.

Three ways, tried in this order, and the report says which one a run used:

- ``drop_caches``: ``sync`` then write ``1`` to ``/proc/sys/vm/drop_caches`` (root, and a
  kernel that lets this namespace do it). Every file's clean pages go.
- ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each of the engine's files (the
  container, the safetensors source, the offload folder). Needs no privilege, drops the clean
  pages of those files only.
- ``o_direct``: nothing could be dropped; only engines that read with O_DIRECT (the zipmoe
  runtime) are cold, the others may be served from the page cache. Said loudly in the report.

:func:`disk_bandwidth` measures sequential O_DIRECT read bandwidth of a file: the fallback for
the I/O floor when `zipmoe plan`'s profile (runtime/plan/profile.py) has not measured it.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def files_of(paths) -> list[Path]:
    """Every regular file under the given files and folders."""
    out: list[Path] = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(q for q in sorted(p.rglob("*")) if q.is_file())
    return out


def can_drop_caches() -> bool:
    return DROP_CACHES.exists() and os.access(DROP_CACHES, os.W_OK)


def fadvise_dontneed(paths) -> int:
    """Ask the kernel to drop the clean cached pages of these files; returns files advised."""
    n = 0
    for f in files_of(paths):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def make_cold(paths=(), allow_drop_caches: bool = True) -> str:
    """Empty the page cache as far as permitted; returns the mode used (see the module doc)."""
    os.sync()
    if allow_drop_caches and can_drop_caches():
        try:
            DROP_CACHES.write_text("1\n")
            return "drop_caches"
        except OSError:
            pass
    if hasattr(os, "posix_fadvise") and fadvise_dontneed(paths):
        return "fadvise"
    return "o_direct"


def cold_mode_available(paths=(), allow_drop_caches: bool = True) -> str:
    """The mode :func:`make_cold` would use, without dropping anything."""
    if allow_drop_caches and can_drop_caches():
        return "drop_caches"
    if hasattr(os, "posix_fadvise") and files_of(paths):
        return "fadvise"
    return "o_direct"


def disk_bandwidth(path, max_bytes: int = 1 << 30, block: int = 8 << 20) -> dict:
    """Sequential read bandwidth of ``path`` (bytes/s), O_DIRECT when the file system allows.

    Reads at most ``max_bytes`` from the start. With O_DIRECT refused (tmpfs, some overlay
    setups) it falls back to buffered reads after dropping the file's cached pages, and says so.
    """
    path = Path(path)
    size = path.stat().st_size
    todo = min(size, max_bytes) // 4096 * 4096
    if todo == 0:
        return {"bytes_per_s": None, "bytes": 0, "seconds": 0.0, "o_direct": False, "file": str(path)}
    buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
    direct = hasattr(os, "O_DIRECT")
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        direct = False
        fadvise_dontneed([path])
        fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        t0 = time.perf_counter()
        while done < todo:
            want = min(block, todo - done)
            try:
                with memoryview(buf) as whole, whole[:want] as view:
                    n = os.preadv(fd, [view], done)
            except OSError:
                if not direct:
                    raise
                os.close(fd)
                direct = False
                fadvise_dontneed([path])
                fd = os.open(path, os.O_RDONLY)
                continue
            if n <= 0:
                break
            done += n
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return {"bytes_per_s": done / seconds if seconds > 0 else None, "bytes": done, "seconds": seconds, "o_direct": direct, "file": str(path)}


def profile_bandwidth(container, container_id: str, device: str = "cpu", profile_path=None, plan_path=None,
                      cache_dir=None) -> dict | None:
    """Disk bandwidth measured by `zipmoe plan` (runtime/plan/profile.py), when there is one.

    In this order: ``--profile FILE`` (checked against this machine and file), the profile a
    plan.json carries, the per-machine profile cache in ``cache_dir`` (None: not looked at). Returns ``{"bytes_per_s", "source"}`` or
    None (nothing is measured here: :func:`disk_bandwidth` is the fallback).
    """
    try:
        from zipmoe.runtime.plan import profile as prof
    except Exception:
        return None
    candidates = []
    if profile_path is not None:
        candidates.append(("--profile " + str(profile_path), lambda: prof.load_profile(profile_path)))
    if plan_path is not None:
        def from_plan():
            doc = json.loads(Path(plan_path).read_text())
            return doc.get("profile") if isinstance(doc.get("profile"), dict) else None
        candidates.append(("the plan's profile", from_plan))
    try:
        if cache_dir is None:
            raise LookupError("no profile cache")
        cached = prof.default_profile_path(container_id, device, cache_dir=cache_dir)
        candidates.append((f"cached profile {cached}", lambda: prof.load_profile(cached) if Path(cached).exists() else None))
    except Exception:
        pass
    for source, get in candidates:
        try:
            p = get()
        except Exception:
            continue
        if not isinstance(p, dict):
            continue
        try:
            if "machine" in p and prof.check_profile(p, container, container_id, device) is not None:
                continue  # stale: another machine or another file
        except Exception:
            continue
        bw = _field(p, ("disk_bw",))
        if bw:
            method = (p.get("disk") or {}).get("method", "")
            return {"bytes_per_s": float(bw), "source": f"zipmoe plan profile ({source}{', ' + method if method else ''})"}
    return None


def _field(obj, names):
    if obj is None:
        return None
    if isinstance(obj, dict):
        for n in names:
            if obj.get(n):
                return obj[n]
        for v in obj.values():  # one level of nesting ({"costs": {...}} or {"disk": {...}})
            if isinstance(v, dict):
                got = _field(v, names)
                if got:
                    return got
        return None
    for n in names:
        v = getattr(obj, n, None)
        if v:
            return v
    costs = getattr(obj, "costs", None)
    return _field(costs, names) if costs is not None else None


if __name__ == "__main__":  # pragma: no cover
    import sys

    out = {"drop_caches_writable": can_drop_caches()}
    if len(sys.argv) > 1:
        out["mode"] = make_cold(sys.argv[1:])
        out["bandwidth"] = disk_bandwidth(sys.argv[1])
    print(json.dumps(out, indent=2))
