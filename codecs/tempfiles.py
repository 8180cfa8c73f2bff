"""Temporary outputs of pack and unpack, and what an interrupted run left behind.

``pack`` writes ``.NAME.PID.HOST.HEX.tmp`` beside the output and renames it when complete;
``unpack`` fills ``.NAME.zipmoe-unpack-PID-HOST-HEX/`` and renames it (PID: the writer's process
id; HOST: 8 hex digits naming the machine and PID namespace it runs in; HEX: 8 random hex
digits). A run killed outright (SIGKILL, power loss) cannot remove them. The next run for the
same output removes those whose process is gone (:func:`remove_stale`), so that nothing piles
up and nothing of a run still going is touched. A PID is only meaningful where it was issued:
names whose HOST is not this machine's and PID namespace's (a pack from another container or
another host writing to the same shared folder) are left alone, as are names in the older
format without HOST, whose process could be anywhere. A leftover ``.tmp`` file never holds the
container magic (the header is written last), so no reader accepts it meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

__all__ = ["pack_temp", "unpack_temp", "remove_stale"]


def host_tag() -> str:
    """8 hex digits for "this machine and PID namespace": where a PID in a temp name means
    something. From the host name and the PID namespace's inode (Linux; 0 elsewhere)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return hashlib.sha1(f"{socket.gethostname()}/{ns}".encode()).hexdigest()[:8]


def pack_temp(out_path: Path) -> Path:
    return out_path.parent / f".{out_path.name}.{os.getpid()}.{host_tag()}.{secrets.token_hex(4)}.tmp"


def unpack_temp(out_dir: Path, parent: Path) -> Path:
    return parent / f".{out_dir.name}.zipmoe-unpack-{os.getpid()}-{host_tag()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OverflowError:  # beyond any pid, so no pack or unpack of ours named it: leave it alone
        return True
    return True


def remove_stale(parent: Path, out_name: str) -> list[str]:
    """Remove the temporary outputs for ``out_name`` in ``parent`` that this machine and PID
    namespace wrote and whose process has exited; returns their names. Files must also lack the
    container magic (all-zero first bytes)."""
    esc = re.escape(out_name)
    pack_re = re.compile(rf"^\.{esc}\.(\d+)\.([0-9a-f]{{8}})\.[0-9a-f]{{8}}\.tmp$")
    unpack_re = re.compile(rf"^\.{esc}\.zipmoe-unpack-(\d+)-([0-9a-f]{{8}})-[0-9a-f]{{8}}$")
    here = host_tag()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pack_re.match(name) or unpack_re.match(name)
        if m is None or m.group(2) != here or _alive(int(m.group(1))):
            continue
        p = parent / name
        try:
            if m.re is pack_re:
                if not p.is_file() or p.is_symlink():
                    continue
                with open(p, "rb") as f:
                    if any(f.read(8)):  # not one of ours: a header was written
                        continue
                p.unlink()
            else:
                if not p.is_dir() or p.is_symlink():
                    continue
                shutil.rmtree(p)
        except OSError:
            continue
        removed.append(name)
    return sorted(removed)
