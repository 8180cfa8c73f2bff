"""The Triton merge/split kernels: under TRITON_INTERPRET=1 on the CPU, and on a real GPU.

The interpreter must be switched on before triton is first imported, so that part runs in a
subprocess with the variable set. The GPU test is marked ``gpu`` and skips without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0xFFFF, 0x7FFF, 0x0001,
           0x8001, 0x807F, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]

_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    from zipmoe.kernels import triton_merge as tm
    SPECIAL = np.array(%r, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for n in (0, 1, 17, tm.BLOCK - 1, tm.BLOCK, tm.BLOCK + 1, 3 * tm.BLOCK + 333):
        u = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        u[: min(n, SPECIAL.size)] = SPECIAL[: min(n, SPECIAL.size)]
        ut = torch.from_numpy(u.view(np.int16).copy())
        e = torch.empty(n, dtype=torch.uint8); s = torch.empty(n, dtype=torch.uint8)
        tm.split_triton(ut, e, s)
        u32 = u.astype(np.uint32)
        assert np.array_equal(e.numpy(), (u32 >> 7) & 0xFF), n
        assert np.array_equal(s.numpy(), ((u32 >> 8) & 0x80) | (u32 & 0x7F)), n
        for dt in (torch.bfloat16, torch.uint16):
            out = torch.full((n,), 7, dtype=dt)
            tm.merge_triton(e, s, out)
            assert torch.equal(out.view(torch.int16), ut), (n, dt)
        # a non-default block size, not dividing n
        out = torch.empty(n, dtype=torch.bfloat16)
        tm.merge_triton(e, s, out, block=256, num_warps=4)
        assert torch.equal(out.view(torch.int16), ut), n
        ref = torch.empty(n, dtype=torch.uint16)
        tm.torch_merge(e, s, ref)
        assert torch.equal(ref.view(torch.int16), ut), n
    print("TRITON-INTERPRET-OK")
    """
) % (SPECIAL,)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'zipmoe[triton]')")
def test_triton_kernels_interpreted(tmp_path):
    """Kernels exact under TRITON_INTERPRET=1; then benchmarks/gpu_merge.py --small in the same
    process (importing torch + triton dominates the time, so it is paid once)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_merge.py"
    out = tmp_path / "r.json"
    code = _SCRIPT + textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = [{str(script)!r}, "--small", "--json", {str(out)!r}]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as exc:
            assert not exc.code, exc.code
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "TRITON-INTERPRET-OK" in r.stdout
    assert "exactness: all checks passed" in r.stdout and "RESULT exact=yes" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["exact"] is True and doc["rows"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("n", [1, 1000, 4095, 4097, 1_000_003, 12_345_679])
def test_triton_merge_gpu_exact(n):
    from zipmoe import kernels

    assert kernels.triton_available()
    g = torch.Generator(device="cuda").manual_seed(n)
    u = torch.randint(-32768, 32768, (n,), dtype=torch.int16, device="cuda", generator=g)
    sp = torch.tensor(np.array(SPECIAL, np.uint16).view(np.int16), device="cuda")
    k = min(n, sp.numel())
    u[:k] = sp[:k]
    e = torch.empty(n, dtype=torch.uint8, device="cuda")
    s = torch.empty(n, dtype=torch.uint8, device="cuda")
    kernels.split(u, e, s)
    ui = u.to(torch.int32) & 0xFFFF
    assert torch.equal(e.to(torch.int32), (ui >> 7) & 0xFF)
    assert torch.equal(s.to(torch.int32), ((ui >> 8) & 0x80) | (ui & 0x7F))
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    assert kernels.merge(e, s, out) is out
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), u)
    # the same bits through the CPU path
    out_cpu = torch.empty(n, dtype=torch.bfloat16)
    kernels.merge(e.cpu(), s.cpu(), out_cpu)
    assert torch.equal(out_cpu.view(torch.int16), u.cpu())


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    from zipmoe import kernels

    with pytest.raises(ValueError):
        kernels.merge(torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8, device="cuda"),
                      torch.empty(4, dtype=torch.bfloat16, device="cuda"))

