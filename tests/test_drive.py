"""benchmarks/drive.sh's paper suite, dry-run (``-n``: prints the stages' commands, runs nothing):
the knobs the GPU sittings are planned with do what docs/bench.md says. A wrong knob costs a
sitting's device time, which no retry gives back."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DRIVE = Path(__file__).resolve().parent.parent / "benchmarks" / "drive.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or not DRIVE.exists(), reason="needs bash and benchmarks/drive.sh")


def dry_run(tmp_path, **env) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("PAPER_")}
    return subprocess.run(["bash", str(DRIVE), "--out", str(tmp_path / "drive"), "-n", "paper"], capture_output=True, text=True,
                          env={**keep, **env}, timeout=60)


def stage_commands(out: str, stage: str) -> list[str]:
    """The commands the dry run prints under ``[stage, ...]``."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s*\[{re.escape(stage)}[,\]]", line):
            cmds = []
            for nxt in lines[i + 1:]:
                if not nxt.strip().startswith("$"):
                    break
                cmds.append(nxt.strip()[2:])
            return cmds
    return []


def test_paper_baselines_default_and_empty(tmp_path):
    """By default both baselines run on each model's source; ``PAPER_BASELINES=`` (set, empty) runs
    none, as ``PAPER_BASELINES_ds=`` does for one model (before, an empty value brought the default
    back: the next sitting's command would have spent its time on them)."""
    default = dry_run(tmp_path)
    assert default.returncode == 0, default.stderr
    for model in ("ds", "sw"):
        cmds = stage_commands(default.stdout, f"{model}-baselines")
        assert cmds and "--engine accelerate --engine deepspeed" in cmds[0]
    empty = dry_run(tmp_path, PAPER_BASELINES="")
    assert empty.returncode == 0, empty.stderr
    for model in ("ds", "sw"):
        assert not any("--engine accelerate" in c or "--engine deepspeed" in c
                       for c in stage_commands(empty.stdout, f"{model}-baselines"))
    one = dry_run(tmp_path, PAPER_BASELINES="accelerate", PAPER_BASELINES_sw="")
    ds, sw = stage_commands(one.stdout, "ds-baselines"), stage_commands(one.stdout, "sw-baselines")
    assert ds and "--engine accelerate" in ds[0] and "--engine deepspeed" not in ds[0]
    assert not any("--engine" in c for c in sw)


def test_paper_engines_and_rounds(tmp_path):
    """``PAPER_FIRST_ENGINES`` / ``PAPER_HALF_ENGINES`` name zipmoe's engines at each budget, Switch's
    included (its default plan is fitted as any model's since its profile serves every state);
    ``PAPER_ROUNDS=N`` passes ``--rounds N``; a bad value stops before anything with exit 2."""
    res = dry_run(tmp_path, PAPER_FIRST_ENGINES="zipmoe zipmoe-default", PAPER_HALF_ENGINES="zipmoe-basic", PAPER_ROUNDS="2")
    assert res.returncode == 0, res.stderr
    for model in ("ds", "sw"):
        first = stage_commands(res.stdout, f"{model}-zipmoe-QUARTER")
        half = stage_commands(res.stdout, f"{model}-zipmoe-HALF")
        assert first and "--engine zipmoe --engine zipmoe-default" in first[0] and "--rounds 2" in first[0]
        assert half and "--engine zipmoe-basic" in half[0] and "--engine zipmoe " not in half[0] + " "
    bad = dry_run(tmp_path, PAPER_ROUNDS="x")
    assert bad.returncode == 2 and "PAPER_ROUNDS" in bad.stderr and bad.stdout == ""
