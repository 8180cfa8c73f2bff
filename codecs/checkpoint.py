"""Read a source checkpoint: a Hugging Face folder or one ``.safetensors`` file.

The safetensors headers are parsed here (not by the ``safetensors`` package) so that every
tensor's byte range is known up front and the bytes can be read with ``os.pread`` into a numpy
buffer, one tensor (or one slice of a tensor) at a time. Nothing maps a whole file: packing a
checkpoint larger than RAM keeps memory bounded by the largest read the caller asks for.

safetensors layout: 8 bytes little-endian ``N``, then ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data buffer; offsets are relative to the start of the buffer (byte ``8 + N`` of the file).

Accepted inputs:

- a folder with ``config.json`` and ``model.safetensors``, or with shards listed by
  ``model.safetensors.index.json`` (only the shards it names are read), or with several
  ``*.safetensors`` files and no index (all of them, sorted by name; a ``consolidated*`` file
  next to other shards is skipped: Mistral repositories ship both);
- one ``.safetensors`` file (``config`` is then ``None`` and ``extra_files`` empty).

Every failure a user can cause is a :class:`~zipmoe.errors.CheckpointError` with one line
naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zipmoe.errors import CheckpointError

__all__ = [
    "DTYPE_SIZES",
    "EXTRA_FILE_NAMES",
    "Checkpoint",
    "SourceTensor",
    "open_checkpoint",
    "read_safetensors_header",
]

#: Bytes per element of each safetensors dtype string that zipmoe understands.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

#: Non-weight files copied into the container (and restored by unpack) when present.
EXTRA_FILE_NAMES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
)

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint and where its bytes are."""

    name: str
    dtype: str  # safetensors dtype string: "BF16", "F32", ...
    shape: tuple
    file: Path
    offset: int  # absolute byte offset in ``file``
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


def _err(path: Path | str, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: {reason}")


def read_safetensors_header(path: Path) -> tuple[list[SourceTensor], dict]:
    """Parse and validate one .safetensors header.

    Returns the tensors sorted by data offset and the ``__metadata__`` dict (``{}`` when absent).
    Raises :class:`CheckpointError` naming the file on anything malformed: a short file, a
    header length past the end, JSON that is not an object, an unknown dtype, a negative or
    non-integer shape, offsets out of the data buffer, overlapping tensors, or a byte count
    that does not match dtype x shape.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _err(path, f"corrupt safetensors header (file is {size} bytes, too short)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or 8 + n > size:
                raise _err(path, f"corrupt safetensors header (header length {n} does not fit a {size}-byte file)")
            raw = f.read(n)
    except OSError as exc:
        raise _err(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(path, f"corrupt safetensors header (invalid JSON: {exc})") from None
    if not isinstance(header, dict):
        raise _err(path, "corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _err(path, "corrupt safetensors header (__metadata__ is not an object)")
    data_start = 8 + n
    data_len = size - data_start
    tensors: list[SourceTensor] = []
    for name, info in header.items():
        bad = lambda why: _err(path, f"corrupt safetensors header (tensor {name!r}: {why})")  # noqa: E731
        if not isinstance(info, dict):
            raise bad("entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise bad(f"unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise bad(f"bad data_offsets {offs!r}")
        if offs[1] > data_len:
            raise bad(f"data_offsets {offs} run past the end of the file (data is {data_len} bytes; truncated?)")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise bad(f"{offs[1] - offs[0]} bytes for a {dtype} tensor of shape {tuple(shape)} ({nbytes} bytes)")
        tensors.append(SourceTensor(name, dtype, tuple(shape), path, data_start + offs[0], nbytes))
    tensors.sort(key=lambda t: (t.offset, t.name))
    end = data_start
    for t in tensors:
        if t.offset < end and t.nbytes:
            raise _err(path, f"corrupt safetensors header (tensor {t.name!r} overlaps the previous one)")
        end = max(end, t.offset + t.nbytes)
    return tensors, meta


def _bin_message(where: Path) -> str:
    return (
        f"{where}: only PyTorch .bin weights found: convert to safetensors first, e.g. "
        f"python -c \"from transformers import AutoModel as M; "
        f"M.from_pretrained('{where}').save_pretrained('{where}-st')\""
    )


def _load_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(path, f"cannot parse JSON: {exc}") from None


class Checkpoint:
    """An opened source checkpoint. Thread-safe reads (``pread`` keeps no file position).

    Use as a context manager or call :meth:`close` to release the file descriptors.
    """

    def __init__(self, root: Path, files: list[Path], tensors: list[SourceTensor],
                 config: dict | None, extra_files: dict[str, Path], metadata: dict[Path, dict],
                 path: Path | None = None):
        self.path = path if path is not None else root  # what the caller opened
        self.source_name = Path(self.path).resolve().name  # or the hub repo id (open_checkpoint)
        self.root = root
        self.files = files
        self.tensors = tensors
        self.config = config
        self.extra_files = extra_files
        self.metadata = metadata
        self.total_bytes = sum(t.nbytes for t in tensors)
        self._by_name = {t.name: t for t in tensors}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    # -- lookup -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self):
        return iter(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def tensor(self, name: str) -> SourceTensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor named {name!r}") from None

    @property
    def model_type(self) -> str | None:
        return (self.config or {}).get("model_type")

    # -- reading ------------------------------------------------------------------------
    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as exc:
                        raise _err(path, f"cannot open: {exc.strerror or exc}") from None
                    self._fds[path] = fd
        return fd

    def read(self, t: SourceTensor | str, start: int = 0, length: int | None = None,
             out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes (or ``length`` bytes from byte ``start``) as a 1-D uint8 array.

        Read with ``pread`` straight into ``out`` (a 1-D contiguous uint8 array of exactly that
        many bytes) or a fresh array. Little-endian, as stored. Raises ``CheckpointError`` if the
        file is shorter than its header says (truncated after opening).
        """
        if isinstance(t, str):
            t = self.tensor(t)
        if length is None:
            length = t.nbytes - start
        if start < 0 or length < 0 or start + length > t.nbytes:
            raise ValueError(f"byte range [{start}, {start + length}) outside tensor {t.name} ({t.nbytes} bytes)")
        if out is None:
            out = np.empty(length, np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.shape[0] != length:
            raise ValueError(f"out must be a 1-D contiguous uint8 array of {length} bytes")
        fd = self._fd(t.file)
        view = memoryview(out)
        pos, done = t.offset + start, 0
        while done < length:
            try:
                got = os.preadv(fd, [view[done:]], pos + done)
            except OSError as exc:
                raise _err(t.file, f"read failed: {exc.strerror or exc}") from None
            if got == 0:
                raise _err(t.file, f"unexpected end of file reading tensor {t.name!r} (truncated?)")
            done += got
        return out

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.root)!r}, {len(self.tensors)} tensors, {self.total_bytes} bytes)"


def _folder_files(root: Path) -> list[Path]:
    index = root / INDEX_NAME
    if index.is_file():
        doc = _load_json(index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise _err(index, "no weight_map of tensor name -> shard file")
        shards = sorted(set(wm.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise _err(index, f"names shard {missing[0]} which is missing{more}")
        return [root / s for s in shards]
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if len(files) > 1:
        files = [p for p in files if not p.name.startswith("consolidated")] or files
    return files


def _check_index(root: Path, tensors: list[SourceTensor]) -> None:
    index = root / INDEX_NAME
    if not index.is_file():
        return
    wm = _load_json(index)["weight_map"]
    where = {t.name: t.file.name for t in tensors}
    for name, shard in wm.items():
        if where.get(name) != shard:
            raise _err(index, f"lists tensor {name!r} in {shard}, which does not hold it")


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a Hugging Face model folder or one .safetensors file (see the module docstring), or
    a hub repo id ``ORG/NAME[@REVISION]`` that is no local path (:mod:`zipmoe.codecs.hub`: from
    the local hub cache, downloaded when allowed). ``source_name`` on the result is the folder's
    name, or the repo id."""
    p = Path(path).expanduser()
    if not p.exists():
        from .hub import is_repo_id, resolve_source

        if not is_repo_id(str(path)):
            raise CheckpointError(f"{p}: no such file or folder")
        ref = resolve_source(str(path), ["*.safetensors", "*.safetensors.index.json", *EXTRA_FILE_NAMES])
        ckpt = open_checkpoint(ref.path)
        ckpt.source_name = ref.name
        return ckpt
    if p.is_file():
        if p.suffix in (".bin", ".pt", ".pth"):
            raise CheckpointError(_bin_message(p))
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p}: not a .safetensors file or a model folder")
        root, files, config, extra = p.parent, [p], None, {}
    elif p.is_dir():
        root = p
        files = _folder_files(p)
        if not files:
            if any(p.glob("*.bin")) or any(p.glob("*.pt")) or any(p.glob("*.pth")):
                raise CheckpointError(_bin_message(p))
            raise CheckpointError(f"{p}: no .safetensors files in this folder")
        config = None
        if (p / "config.json").is_file():
            config = _load_json(p / "config.json")
            if not isinstance(config, dict):
                raise _err(p / "config.json", "not a JSON object")
        extra = {n: p / n for n in EXTRA_FILE_NAMES if (p / n).is_file()}
    else:
        raise CheckpointError(f"{p}: not a regular file or folder")

    tensors: list[SourceTensor] = []
    metadata: dict[Path, dict] = {}
    seen: dict[str, Path] = {}
    for f in files:
        ts, meta = read_safetensors_header(f)
        metadata[f] = meta
        for t in ts:
            if t.name in seen:
                raise _err(f, f"tensor {t.name!r} also appears in {seen[t.name].name}")
            seen[t.name] = f
        tensors.extend(ts)
    if p.is_dir():
        _check_index(p, tensors)
    return Checkpoint(root, files, tensors, config, extra, metadata, path=p)
