"""Shared test setup: no hub, few threads, small checkpoints built on the spot."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NUMBA_NUM_THREADS", "2")


import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bench_script():
    """``bench_script(NAME)``: the module benchmarks/NAME.py (a script, not part of the package)."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def tiny_mixtral_container(tmp_path_factory):
    """``(path, container_id)`` of the tiny synthetic Mixtral (skewed routing) packed once per
    session: the planner's tests plan and serve it."""
    synth = pytest.importorskip("zipmoe.runtime.synth.writer")
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.codecs.writer import pack

    d = tmp_path_factory.mktemp("tiny-mixtral")
    synth.write("mixtral", d / "ck", preset="tiny", skew=1.0, progress=False)
    pack(d / "ck", d / "m.zmoe")
    with ContainerReader(d / "m.zmoe") as r:
        return d / "m.zmoe", r.container_id
