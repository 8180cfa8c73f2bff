"""`zipmoe verify`'s check of a container: :func:`verify_container`.

Opening the file (:class:`~zipmoe.codecs.reader.ContainerReader`) already checks the header,
the index, the bounds on every size and every entry's metadata against the naming rules
(docs/format.md 4, 4.1, 6.1); this module adds what needs the data: every padding byte zero,
every chunk's checksum, every entry decoded, and with ``against`` every tensor compared bit for
bit with the source checkpoint.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from zipmoe.errors import ContainerError

from .format import TensorEntry
from .reader import ContainerReader
from .safetensors_out import plan_tensors

__all__ = ["VerifyReport", "verify_container"]


class VerifyReport:
    """What :func:`verify_container` checked."""

    def __init__(self) -> None:
        self.entries = 0
        self.bytes = 0
        self.files = 0
        self.compared = False
        self.seconds = 0.0


def verify_container(path, against=None, workers: int | None = None,
                     progress=None) -> VerifyReport:
    """Check every checksum, decode every entry, check padding; with ``against`` (a source
    checkpoint path) compare each tensor bit for bit. Raises at the first problem, in file
    order: :class:`ChecksumError` naming tensor and chunk, or :class:`ContainerError`.
    """
    from zipmoe.machine import pack_workers

    t0 = time.perf_counter()
    rep = VerifyReport()
    workers = workers or pack_workers()
    ckpt = None
    if against is not None:
        from .checkpoint import open_checkpoint

        ckpt = open_checkpoint(against)
    try:
        with ContainerReader(path) as r:
            r.check_padding()
            for name in r.files:
                data = r.read_file(name)
                if ckpt is not None and name in ckpt.extra_files:
                    if Path(ckpt.extra_files[name]).read_bytes() != data:
                        raise ContainerError(f"embedded file {name} differs from the source")
                rep.files += 1
            if ckpt is not None:
                _check_coverage(r, ckpt)
            total = sum(e.nbytes for e in r.entries)

            def check(e: TensorEntry):
                out = r.decode_entry(e)
                if ckpt is not None:
                    _compare(e, out, ckpt)
                return e.nbytes

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zipmoe-verify") as pool:
                window: deque = deque()
                entries = iter(r.entries)
                while True:
                    while len(window) < 2 * workers:
                        e = next(entries, None)
                        if e is None:
                            break
                        window.append(pool.submit(check, e))
                    if not window:
                        break
                    rep.bytes += window.popleft().result()
                    rep.entries += 1
                    if progress:
                        progress(rep.bytes, total)
    finally:
        if ckpt is not None:
            ckpt.close()
    rep.compared = ckpt is not None
    rep.seconds = time.perf_counter() - t0
    return rep


def _label(e: TensorEntry) -> str:
    return f"{e.name} (expert {e.fused_index})" if e.fused_index is not None else e.name


def _check_coverage(r: ContainerReader, ckpt) -> None:
    plans = {p.name: p for p in plan_tensors(r.entries)}
    for t in ckpt.tensors:
        p = plans.get(t.name)
        if p is None:
            raise ContainerError(f"tensor {t.name} of the source is missing from the container")
        if p.dtype != t.dtype or tuple(p.shape) != tuple(t.shape):
            raise ContainerError(f"tensor {t.name}: container has {p.dtype} {list(p.shape)}, source has {t.dtype} {list(t.shape)}")
    extra = set(plans) - {t.name for t in ckpt.tensors}
    if extra:
        raise ContainerError(f"tensor {sorted(extra)[0]} of the container is not in the source")


def _compare(e: TensorEntry, out: np.ndarray, ckpt) -> None:
    st = ckpt.tensor(e.name)
    start = e.fused_index * e.nbytes if e.fused_index is not None else 0
    src = ckpt.read(st, start, e.nbytes)
    if not np.array_equal(src, out):
        i = int(np.flatnonzero(src != out)[0])
        raise ContainerError(f"tensor {_label(e)} differs from the source at byte {i}")
