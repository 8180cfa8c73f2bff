"""Ending a benchmark's child process with everything it started.

A process group is not enough: ninja (which torch's extension builder runs for DeepSpeed's
ops) puts every compiler it starts in a process group of its own, so ``killpg`` on the child
left its g++ processes running. :func:`kill_tree` walks the process tree instead.
"""

from __future__ import annotations

import psutil

__all__ = ["kill_tree"]


def kill_tree(pid: int) -> int:
    """SIGKILL ``pid`` and all its descendants (found before any is killed); how many were killed.
    ``pid`` itself is not reaped: its parent's ``wait`` still sees the signal."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    killed = 0
    for p in [root, *descendants]:
        try:
            p.kill()
            killed += 1
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=5)
    return killed
