"""zipmoe.kernels: merge (and split) kernels: numba on the CPU, Triton on CUDA.

``merge(exp, sm, out)`` picks the kernel by device (see :mod:`.dispatch`);
``triton_available()`` says whether the CUDA path can run here. Knows nothing of files.
"""

from .dispatch import merge, split, triton_available

__all__ = ["merge", "split", "triton_available"]
