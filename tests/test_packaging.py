"""The folders codecs/, kernels/ and runtime/ install as zipmoe.codecs, zipmoe.kernels, zipmoe.runtime.

Checked both ways a user gets the package: the editable install this suite runs under, and
a built wheel (its file list, then an import from the unpacked wheel in a clean interpreter).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_imports_subpackages():
    import zipmoe.codecs
    import zipmoe.kernels
    import zipmoe.runtime

    assert Path(zipmoe.codecs.__file__).parent.name == "codecs"
    assert Path(zipmoe.kernels.__file__).parent.name == "kernels"
    assert Path(zipmoe.runtime.__file__).parent.name == "runtime"


@pytest.mark.slow
def test_wheel_file_list_and_import(tmp_path):
    pytest.importorskip("build")
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("zipmoe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for required in (
        "zipmoe/__init__.py", "zipmoe/errors.py", "zipmoe_cli/app.py",
        "zipmoe/codecs/__init__.py", "zipmoe/kernels/__init__.py", "zipmoe/kernels/cpu.py",
        "zipmoe/runtime/__init__.py", "zipmoe/runtime/synth/__init__.py",
    ):
        assert required in names, f"{required} missing from the wheel"
    # Nothing may land as a top-level codecs/kernels/runtime package (it would shadow the stdlib).
    assert not any(n.split("/")[0] in {"codecs", "kernels", "runtime"} for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = "import zipmoe.codecs, zipmoe.kernels, zipmoe.runtime, zipmoe_cli.app; print(zipmoe.codecs.__file__)"
    proc = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert str(target) in proc.stdout
