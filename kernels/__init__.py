"""zipmoe.kernels: merge (and split) kernels: numba on the CPU, Triton on CUDA."""
