# zipmoe tasks. `scripts/bootstrap` makes .venv (and installs `just` into it).
set shell := ["bash", "-euo", "pipefail", "-c"]
export HF_HUB_OFFLINE := "1"
export PATH := justfile_directory() + "/.venv/bin:" + env_var('PATH')

demo_dir := "out/demo"

# List the recipes.
default:
    @just --list

# The main job on the built-in demo model: build it, analyze, pack, verify, chat one turn.
demo:
    mkdir -p out
    [ -f {{demo_dir}}/config.json ] || zipmoe synth demo -o {{demo_dir}}
    zipmoe analyze {{demo_dir}} | tail -n 6
    zipmoe pack {{demo_dir}} -o out/demo.zmoe --force
    zipmoe verify out/demo.zmoe --against {{demo_dir}}
    zipmoe chat out/demo.zmoe --budget 800M --greedy --max-new-tokens 40 --prompt "What is the capital of France?"

# Run the test suite (what CI runs).
test:
    python -m pytest -q -p no:cacheprovider

# The quick tests only.
test-fast:
    python -m pytest -q -m "not slow" -p no:cacheprovider

# Every module's size in lines, largest first (a report; no module has a line limit).
sizes:
    python tests/test_layout.py

# The benchmark suites, one driver (`just drive --list`; `just drive -n headline` prints the commands).
drive *args:
    @bash benchmarks/drive.sh {{args}}
