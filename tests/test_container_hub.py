"""Hub repo ids (``ORG/NAME[@REVISION]``) for pack, analyze and verify --against, offline.

The tests build a hub cache laid out as huggingface_hub lays it out (``models--ORG--NAME`` with
``refs/<branch or tag>`` holding a commit hash, ``snapshots/<hash>/<file>`` symlinks into
``blobs/<sha256>``) in a temporary folder and run offline: nothing is downloaded, a repo id
that is not cached is one line. huggingface_hub reads HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE
when it is imported (``huggingface_hub.constants``), and zipmoe uses its constants: the tests
set those (and check, in a fresh interpreter, that the environment reaches them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli_pack import assert_one_line_error, run
from test_container_helpers import write_mixtral
from zipmoe.codecs.checkpoint import open_checkpoint
from zipmoe.codecs.hub import is_repo_id, resolve_source
from zipmoe.codecs.reader import ContainerReader
from zipmoe.errors import CheckpointError

MAIN = "a" * 40
V1 = "b" * 40


def add_snapshot(cache: Path, repo: str, commit: str, folder: Path, refs: tuple = ()) -> Path:
    """Put ``folder``'s files in the hub cache as snapshot ``commit`` of ``repo``, pointed to by
    ``refs`` (branch or tag names), the way huggingface_hub stores a download."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        if not (root / "blobs" / blob).exists():
            shutil.copyfile(f, root / "blobs" / blob)
        os.symlink(Path("..", "..", "blobs", blob), snap / f.name)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    write_mixtral(base / "src_main", seed=0, sharded=False)
    write_mixtral(base / "src_v1", seed=1, sharded=False)
    cache = base / "hf" / "hub"
    add_snapshot(cache, "org/mx", MAIN, base / "src_main", refs=("main",))
    add_snapshot(cache, "org/mx", V1, base / "src_v1", refs=("v1",))
    return base


@pytest.fixture
def hf_home(hub, monkeypatch):
    """huggingface_hub's cache at ``hub/hf/hub``, offline (what HF_HOME=hub/hf and
    HF_HUB_OFFLINE=1 give a process that starts with them)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def _hub_cache_in_a_fresh_process(env: dict) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, "-c", "from zipmoe.codecs.hub import hub_cache_dir; print(hub_cache_dir())"],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_environment_chooses_the_cache_through_huggingface_hub(tmp_path):
    """HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub: huggingface_hub's rule."""
    assert _hub_cache_in_a_fresh_process({"HF_HOME": str(tmp_path / "h")}) == str(tmp_path / "h" / "hub")
    assert _hub_cache_in_a_fresh_process({"HF_HOME": str(tmp_path / "h"), "HF_HUB_CACHE": str(tmp_path / "c")}) == str(tmp_path / "c")
    assert _hub_cache_in_a_fresh_process({"XDG_CACHE_HOME": str(tmp_path / "x")}) == str(tmp_path / "x" / "huggingface" / "hub")


def test_an_explicit_cache_dir_wins(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snaps = hub / "hf" / "hub" / "models--org--mx" / "snapshots"
    assert resolve_source("org/mx@v1", cache_dir=hub / "hf" / "hub").path == snaps / V1
    with pytest.raises(CheckpointError, match=re.escape(f"not in the local hub cache ({tmp_path / 'elsewhere'})")):
        resolve_source("org/mx@v1")


def test_repo_id_shape():
    assert is_repo_id("org/name") and is_repo_id("Org-1/na.me_2@v1.0") and is_repo_id("org/name@" + MAIN)
    for bad in ("name", "org/name/x", "/abs/path", "./org", "org/", "org/name@", "a/../b", "org/na me"):
        assert not is_repo_id(bad), bad


def test_resolves_refs_and_commits_from_the_cache(hf_home):
    snaps = hf_home / "hf" / "hub" / "models--org--mx" / "snapshots"
    assert resolve_source("org/mx").path == snaps / MAIN
    assert resolve_source("org/mx@main").path == snaps / MAIN
    assert resolve_source("org/mx@v1").path == snaps / V1
    assert resolve_source(f"org/mx@{V1}").path == snaps / V1
    assert resolve_source("org/mx@v1").name == "org/mx@v1"


def test_pack_analyze_verify_with_repo_ids(hf_home, tmp_path, capsys):
    out = tmp_path / "mx.zmoe"
    code, _, err = run(capsys, "pack", "org/mx", "-o", out, "--workers", "1")
    assert code == 0, err
    with ContainerReader(out) as r:
        assert r.meta["source"]["name"] == "org/mx"
    code, _, err = run(capsys, "verify", out, "--against", "org/mx")
    assert code == 0, err
    code, _, err = run(capsys, "verify", out, "--against", hf_home / "src_main")  # the same bytes, by folder
    assert code == 0, err
    code, _, err = run(capsys, "verify", out, "--against", "org/mx@v1")  # another revision: other weights
    assert_one_line_error(code, err, "differs from the source")
    code, out_text, err = run(capsys, "analyze", "org/mx@v1", "--json")
    assert code == 0, err
    assert json.loads(out_text)["total"]


def test_a_revision_packs_its_own_weights(hf_home, tmp_path, capsys):
    out = tmp_path / "v1.zmoe"
    code, _, err = run(capsys, "pack", "org/mx@v1", "-o", out, "--workers", "1")
    assert code == 0, err
    code, _, err = run(capsys, "verify", out, "--against", hf_home / "src_v1")
    assert code == 0, err


def test_a_local_folder_wins_over_a_repo_id(hf_home, tmp_path, capsys, monkeypatch):
    write_mixtral(tmp_path / "org" / "mx", seed=7, sharded=False)
    monkeypatch.chdir(tmp_path)
    with open_checkpoint("org/mx") as ck:
        assert Path(ck.root).resolve() == (tmp_path / "org" / "mx").resolve()


@pytest.mark.parametrize("spec", ["org/missing", "org/mx@v9"])
def test_repo_id_neither_cached_nor_reachable_is_one_line(hf_home, tmp_path, capsys, spec):
    before = sorted(os.listdir(tmp_path))
    for cmd in (["pack", spec, "-o", tmp_path / "x.zmoe"], ["analyze", spec],
                ["verify", tmp_path / "x.zmoe", "--against", spec]):
        code, _, err = run(capsys, *cmd)
        if cmd[0] == "verify":  # the container is missing too: either line is one line
            assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
            continue
        assert_one_line_error(code, err, f"{spec}: no such folder", "not in the local hub cache", "HF_HUB_OFFLINE")
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(CheckpointError, match="not in the local hub cache"):
        open_checkpoint(spec)


def test_verify_against_a_missing_repo_id(hf_home, tmp_path, capsys):
    out = tmp_path / "mx.zmoe"
    assert run(capsys, "pack", "org/mx", "-o", out, "--workers", "1")[0] == 0
    code, _, err = run(capsys, "verify", out, "--against", "org/missing")
    assert_one_line_error(code, err, "org/missing: no such folder", "not in the local hub cache")
