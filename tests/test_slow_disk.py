"""benchmarks/slow_disk.sh: its usage errors (exit 2, one line on stderr) before any cgroup is made."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "slow_disk.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "usage: slow_disk.sh"),
        (("300M",), "no command given after --"),
        (("fast", "--", "true"), "cannot read rate 'fast'"),
        (("0", "--", "true"), "rate must be above 0"),
        (("300M", "200M", "--", "true"), "one RATE only"),
        (("-x", "1M", "--", "true"), "unknown option -x"),
        (("-f", "/nonexistent/file", "1M", "--", "true"), "no such file: /nonexistent/file"),
        (("-d", "nonsense", "1M", "--", "true"), "bad device 'nonsense'"),
    ],
)
def test_usage_errors(args, message):
    r = run(*args)
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slow_disk.sh: ") and message in lines[0]


def test_help():
    r = run("--help")
    assert r.returncode == 0 and "RATE" in r.stdout and "100 ms" in r.stdout
