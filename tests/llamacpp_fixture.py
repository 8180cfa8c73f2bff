"""llama.cpp's converter for the tests that convert with it (test_llamacpp_convert.py,
test_baselines_e2e.py): fetched once per test session, the way bench fetches it (the installed
llama-cpp-python's sdist, else the newest, through pip), into the session's temporary folder.
Skipped with the reason only when the package index cannot be reached."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_FOLDER: dict[str, Path] = {}


def converter_folder(tmp_path_factory) -> Path:
    from zipmoe.runtime.bench import llamacpp_convert as lc

    if "path" not in _FOLDER:
        cache = tmp_path_factory.getbasetemp() / "llamacpp-cache"
        try:
            _FOLDER["path"] = lc.resolve_converter(None, cache)
        except lc.GGUFError as exc:
            if "not reachable" in str(exc):
                pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
            raise
    return _FOLDER["path"]


def gguf_module(folder: Path):
    """The ``gguf`` package to read GGUF files with: the installed one, else the converter's gguf-py."""
    if importlib.util.find_spec("gguf") is None:
        sys.path.insert(0, str(Path(folder) / "gguf-py"))
    import gguf

    return gguf
