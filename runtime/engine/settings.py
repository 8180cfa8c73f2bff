"""Every switch of the engine in one object: :class:`EngineSettings`.

The engine reads no environment variable and no module flag: what changes its behaviour is a
field here, passed down by whoever builds the engine (``zipmoe.load(..., settings=...)`` or the
same names as keyword arguments). The command line (``zipmoe_cli``) is the only place that reads
the environment (``ZIPMOE_READERS``, ``ZIPMOE_PREFETCH``, ...: ``zipmoe_cli/env.py``) and turns
it into fields of this object. docs/architecture.md lists the fields with their defaults.

Torch-free: the command line builds one before it imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from zipmoe.errors import UsageError

__all__ = ["EngineSettings", "DEFAULT_READERS", "DEFAULT_AGE_TOKENS", "KERNELS", "GRAPHS", "ATTENTION",
           "check_attention"]

DEFAULT_READERS = 4  # reader threads (queue depth); benchmarks/read_qd.py measures the disk's curve
DEFAULT_AGE_TOKENS = 4096  # the cache's counts halve every this many tokens (batch 1; engine/cache.py)
KERNELS = ("exact", "fast")
GRAPHS = ("auto", "on", "off")
ATTENTION = ("reproducible", "pytorch")  # engine/step.py: attention_kernels


def check_attention(value: str) -> str:
    """``value`` when it names an attention choice, else a one-line :class:`UsageError`."""
    if value not in ATTENTION:
        raise UsageError(f"attention must be one of {', '.join(ATTENTION)}, not {value!r}")
    return value


@dataclass(frozen=True)
class EngineSettings:
    """How the engine serves one model (every field has the default a user gets).

    ``workers``: decode threads (None: :func:`zipmoe.machine.decode_workers`, half the cores).
    ``readers``: reader threads, i.e. the queue depth of expert reads.
    ``direct_io``: read experts with O_DIRECT where the file system allows.
    ``prefetch``: read and decode the experts the next layer will probably choose (None: on
    for CUDA, off on the CPU, where mispredicted decodes take cores from the compute).
    ``slots``: hold the full pool in device slot tensors with an expert->slot map (what CUDA
    graphs gather from; None: on CUDA).
    ``kernels``: ``exact`` (the experts as transformers' eager loop computes them) or ``fast``
    (transformers' grouped_mm over the slots; every expert resident).
    ``cache_age``: the cache's counts halve every this many tokens (0: never).
    ``force``: load even when the process's memory limit is below what serving needs.
    ``graphs``: the decode loop's CUDA graphs: ``auto`` (where supported), ``on`` (required),
    ``off``.
    ``batched_sparse``: with graphs, the sparse blocks at batch > 1 replay graphs too
    (``False``: they run on the host path).
    ``device_merge``: on CUDA, merge E and SM bytes on the device with Triton (None: when
    Triton is available; ``False``: the decode workers merge on the host).
    ``attention``: on CUDA, which ``scaled_dot_product_attention`` kernels a step may use:
    ``reproducible`` (flash, memory-efficient or math: the same bits in every run) or
    ``pytorch`` (PyTorch's own order, which on Hopper puts cuDNN's kernel first: it is not
    deterministic, and the same step can round differently from run to run). The CPU has no
    cuDNN kernel: both are the same there. engine/step.py ``attention_kernels``.
    """

    workers: int | None = None
    readers: int = DEFAULT_READERS
    direct_io: bool = True
    prefetch: bool | None = None
    slots: bool | None = None
    kernels: str = "exact"
    cache_age: int = DEFAULT_AGE_TOKENS
    force: bool = False
    graphs: str = "auto"
    batched_sparse: bool = True
    device_merge: bool | None = None
    attention: str = "reproducible"

    def __post_init__(self) -> None:
        if self.workers is not None and int(self.workers) < 1:
            raise UsageError("--workers must be at least 1")
        if int(self.readers) < 1:
            raise UsageError("--readers must be at least 1")
        if self.kernels not in KERNELS:
            raise UsageError(f"unknown kernels {self.kernels!r} (use exact or fast)")
        if self.graphs not in GRAPHS:
            raise UsageError(f"graphs must be one of {', '.join(GRAPHS)}, not {self.graphs!r}")
        check_attention(self.attention)
        if int(self.cache_age) < 0:
            raise UsageError("cache_age must be 0 (never) or more tokens")

    def with_(self, **changes) -> "EngineSettings":
        """A copy with ``changes`` (None values are left out: "not given")."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def resolved(self, device_type: str) -> "EngineSettings":
        """The defaults that depend on the device filled in (``prefetch``, ``slots``)."""
        cuda = device_type == "cuda"
        return replace(self, prefetch=cuda if self.prefetch is None else bool(self.prefetch),
                       slots=cuda if self.slots is None else bool(self.slots))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
