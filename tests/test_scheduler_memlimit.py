"""Memory limit at load (engine/memlimit.py): a limit below baseline + budget + KV cache is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe.errors import BudgetError
from zipmoe.runtime.engine.memlimit import check, kv_cache_bytes, limits

from test_runtime_fixtures import container

GiB = 1 << 30


def _fake_cgroup(tmp_path: Path, v2_limit: str | None, parent_limit: str | None = None, v1_limit: str | None = None):
    root = tmp_path / "cg"
    proc = tmp_path / "proc_cgroup"
    lines = []
    if v2_limit is not None:
        (root / "a" / "b").mkdir(parents=True)
        (root / "a" / "b" / "memory.max").write_text(v2_limit + "\n")
        if parent_limit is not None:
            (root / "a" / "memory.max").write_text(parent_limit + "\n")
        lines.append("0::/a/b")
    if v1_limit is not None:
        (root / "memory" / "x").mkdir(parents=True)
        (root / "memory" / "x" / "memory.limit_in_bytes").write_text(v1_limit)
        lines.append("4:memory:/x")
    proc.write_text("\n".join(lines) + "\n")
    status = tmp_path / "status"
    status.write_text("VmSize:\t 4000000 kB\nVmData:\t 900000 kB\nVmRSS:\t  500000 kB\n")  # RSS 488 MiB
    return dict(proc_cgroup=str(proc), root=str(root), status=str(status))


def test_cgroup_v2_limit_below_need_is_refused_with_the_figures(tmp_path):
    where = _fake_cgroup(tmp_path, str(800 * 2**20))  # the 0.8 GB cgroup of the issue
    assert [lim for lim, kind, _ in limits(where["proc_cgroup"], where["root"]) if kind == "cgroup"] == [800 * 2**20]
    with pytest.raises(BudgetError) as e:
        check(280 * 2**20, 64 * 2**20, **where)
    msg = str(e.value)
    assert "\n" not in msg and "800.00 MiB" in msg and "memory.max" in msg and "--force" in msg
    assert "budget 280.00 MiB" in msg and "KV cache 64.00 MiB" in msg and "already in use" in msg
    fig = check(280 * 2**20, 64 * 2**20, force=True, **where)
    assert fig["limit"] == 800 * 2**20 and fig["need"] == 500000 * 1024 + 344 * 2**20
    assert check(100 * 2**20, 0, **where)["limit"] == 800 * 2**20  # it fits: no complaint


def test_the_tightest_ancestor_and_v1_count_and_max_means_none(tmp_path):
    where = _fake_cgroup(tmp_path, "max", parent_limit=str(GiB))
    assert [lim for lim, kind, _ in limits(where["proc_cgroup"], where["root"]) if kind == "cgroup"] == [GiB]
    with pytest.raises(BudgetError):
        check(GiB, 0, **where)
    where = _fake_cgroup(tmp_path / "v1", None, v1_limit=str(GiB))
    assert [lim for lim, kind, _ in limits(where["proc_cgroup"], where["root"]) if kind == "cgroup"] == [GiB]
    where = _fake_cgroup(tmp_path / "none", "max", v1_limit=str(1 << 62))  # v1's "unlimited"
    assert [k for _, k, _ in limits(where["proc_cgroup"], where["root"]) if k == "cgroup"] == []


def test_kv_cache_estimate():
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_cache_bytes(cfg, 2, tokens=1000) == 30 * 2 * 3 * 64 * 2 * 1000


@pytest.mark.parametrize("which", ["RLIMIT_DATA", "RLIMIT_AS"])
def test_rlimit_in_a_subprocess_refuses_the_load_and_force_proceeds(tmp_path_factory, which):
    _, path = container(tmp_path_factory, "qwen3_moe")
    code = (
        "import resource, sys, zipmoe, torch, transformers\n"
        "import zipmoe.runtime.engine.loader, zipmoe.runtime.engine.core, zipmoe.codecs.reader\n"
        "import transformers.models.qwen3_moe.modeling_qwen3_moe\n"
        "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer\n"
        "from zipmoe.runtime.engine.memlimit import process_memory\n"
        "m = process_memory()\n"
        f"base = m['{'size' if which == 'RLIMIT_AS' else 'data'}']\n"
        f"resource.setrlimit(resource.{which}, (base + (768 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    zipmoe.load(sys.argv[1], budget='1G', workers=1, force=sys.argv[2] == '1')\n"
        "except zipmoe.errors.BudgetError as e:\n"
        "    print('REFUSED', e); sys.exit(3)\n"
        "print('LOADED')\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("ZIPMOE_FORCE", None)
    p = subprocess.run([sys.executable, "-c", code, str(path), "0"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 3, p.stderr[-2000:]
    line = p.stdout.strip()
    assert line.startswith("REFUSED") and which in line and "budget 1.00 GiB" in line and "--force" in line
    p = subprocess.run([sys.executable, "-c", code, str(path), "1"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "LOADED" in p.stdout, p.stderr[-2000:]
