"""zipmoe: serve Mixture-of-Experts models from SSD, losslessly compressed, bit for bit.

The public Python API is small::

    import zipmoe
    model, tokenizer = zipmoe.load("model.zmoe", budget="8G", device="auto")

Subpackages: ``zipmoe.codecs`` (bit fields, exponent codecs, the .zmoe container),
``zipmoe.kernels`` (merge/split kernels, numba on the CPU, Triton on CUDA) and
``zipmoe.runtime`` (``engine``: what serves a model, settings in ``EngineSettings``;
``server``: the HTTP server of ``zipmoe serve``; ``plan``: the planner; ``bench``: the benchmark
harness; ``synth``: synthetic checkpoints). The base modules ``zipmoe.errors``,
``zipmoe.units``, ``zipmoe.version`` and ``zipmoe.machine`` are importable from every layer
(docs/architecture.md).
"""

from __future__ import annotations

from .errors import ZipmoeError

from .version import __version__

__all__ = ["ZipmoeError", "__version__", "load"]


def load(path, budget="8G", device="auto", plan=None, **kwargs):
    """Load a .zmoe container as a transformers model served under a memory budget.

    Returns ``(model, tokenizer)``. Dense weights are resident; expert weights come from the
    container on demand. See ``zipmoe.runtime.engine.loader.load`` for every option.
    """
    from .runtime.engine.loader import load as _load

    return _load(path, budget=budget, device=device, plan=plan, **kwargs)
