"""The exceptions zipmoe raises for things a user can get wrong.

Every layer raises a subclass of :class:`ZipmoeError` with a message written for the
person at the terminal: one line, saying what is wrong and, where it helps, what to do.
The CLI prints that line on stderr and exits non-zero; the traceback only appears with
``--debug``.
"""

from __future__ import annotations


class ZipmoeError(Exception):
    """Base class: a failure the user can understand and act on."""

    exit_code = 1


class UsageError(ZipmoeError):
    """A bad argument or option value (a size that does not parse, an unknown name)."""

    exit_code = 2


class CheckpointError(ZipmoeError):
    """The source checkpoint (a Hugging Face folder or a .safetensors file) is unusable."""


class ContainerError(ZipmoeError):
    """A .zmoe file is truncated, corrupted, of a future version or otherwise unreadable."""


class ChecksumError(ContainerError):
    """A chunk's stored bytes do not match the checksum in the index."""


class UnknownCodecError(ContainerError):
    """A codec id that this version of zipmoe does not know."""


class OutOfSpaceError(ZipmoeError):
    """The disk filled up while writing; the partial output was removed."""


class BudgetError(ZipmoeError):
    """A memory budget too small for what must stay resident."""


class DeviceError(ZipmoeError):
    """The requested device is not available (e.g. --device cuda without a GPU)."""


class ModelError(ZipmoeError):
    """An unsupported architecture or a model/plan/trace mismatch."""


class ServingError(ZipmoeError):
    """A reader or decode thread failed while serving (an I/O error, or a bug): the layer that
    waited for it stops with this one line instead of waiting forever."""
