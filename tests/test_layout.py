"""The package's layout: imports point one way, no module imports another around a cycle, and the
command line's help imports no torch. A module is as long as its one job needs: there is no
line limit, but ``python tests/test_layout.py`` (``just sizes``) prints every module's size,
largest first, for a reviewer to see where a module grew.

Imports are read with ``ast`` from the source files (nothing is imported), at any depth:
imports inside functions count as much as those at the top (a function-level import that goes
upward is still a cycle, only a later one). A new subpackage or base module goes in ``LAYERS``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where each installed package's files are (pyproject.toml's package-dir).
FOLDERS = {"zipmoe": "zipmoe", "zipmoe_cli": "zipmoe_cli", "zipmoe.codecs": "codecs",
           "zipmoe.kernels": "kernels", "zipmoe.runtime": "runtime"}

# The layers, lowest first. A module may import modules of its own group and of any group in a
# lower layer; groups of one layer are side by side and may not import each other. A module
# belongs to the group with the longest prefix of its name.
LAYERS = [
    {"base": ["zipmoe.errors", "zipmoe.units", "zipmoe.version", "zipmoe.machine"]},  # importable from everywhere
    {"kernels": ["zipmoe.kernels"]},
    {"codecs": ["zipmoe.codecs"]},
    {"engine": ["zipmoe.runtime.engine"], "synth": ["zipmoe.runtime.synth"]},
    {"plan": ["zipmoe.runtime.plan"], "server": ["zipmoe.runtime.server"]},  # the HTTP server (serves, plans nothing)
    {"bench": ["zipmoe.runtime.bench"]},
    {"runtime": ["zipmoe.runtime"]},  # the runtime package's own __init__
    {"public API": ["zipmoe"]},  # zipmoe/__init__.py: zipmoe.load
    {"cli": ["zipmoe_cli"]},
]

# Cycles known and being removed elsewhere; each entry must still be a cycle (delete it once gone).
KNOWN_CYCLES: list = []



def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _known(name: str) -> str | None:
    """The module ``name`` refers to (a module, else the package that defines the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> dict[str, int]:
    """The project modules ``module`` imports, with the line of the first import of each."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]  # importlib.import_module("zipmoe....")
        for name in names:
            target = _known(name) if name.split(".")[0] in ("zipmoe", "zipmoe_cli") else None
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def _group(module: str) -> tuple[int, str]:
    best = None
    for rank, layer in enumerate(LAYERS):
        for group, prefixes in layer.items():
            for p in prefixes:
                if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[2]):
                    best = (rank, group, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layout.py"
    return best[0], best[1]


def test_every_module_has_a_layer():
    assert len(MODULES) > 50
    for m in MODULES:
        _group(m)


def test_no_module_imports_upward_or_sideways():
    bad = []
    for m in MODULES:
        rank, group = _group(m)
        for target, line in imports(m).items():
            t_rank, t_group = _group(target)
            if t_group != group and t_rank >= rank:
                how = "upward" if t_rank > rank else "sideways"
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} ({group}) imports {target} ({t_group}), {how}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def _path(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One cycle through the component's first module, for the message."""
    start = comp[0]
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & set(comp)):
            if w == start:
                chain = [v]
                while prev[chain[-1]] is not None:
                    chain.append(prev[chain[-1]])
                return " -> ".join([*reversed(chain), start])
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return ", ".join(comp)  # pragma: no cover


def test_no_import_cycles():
    graph = {m: set(imports(m)) for m in MODULES}
    cycles = _cycles(graph)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "modules importing each other:\n" + "\n".join(_path(graph, c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, delete it from KNOWN_CYCLES in tests/test_layout.py: {gone}"


def test_the_checks_can_fail():
    """The cycle finder and the layer table see what they should (on made-up modules)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _path(g, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert _group("zipmoe.codecs.writer")[1] == "codecs"
    assert _group("zipmoe.runtime.plan.profile")[0] > _group("zipmoe.runtime.engine.loader")[0]
    assert _group("zipmoe.errors")[1] == "base" and _group("zipmoe")[1] == "public API"
    assert _group("zipmoe.runtime.server.app")[1] == "server"
    assert imports("zipmoe_cli.app").keys() >= {"zipmoe_cli.plan", "zipmoe.errors", "zipmoe.version"}


def module_sizes() -> list[tuple[int, str]]:
    """``(lines, path)`` of every module, largest first: the report ``just sizes`` prints."""
    rows = [(len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(ROOT))) for p in MODULES.values()]
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def test_size_report_lists_every_module():
    rows = module_sizes()
    assert len(rows) == len(MODULES)
    assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True)
    assert {r[1] for r in rows} == {str(p.relative_to(ROOT)) for p in MODULES.values()}


def test_help_imports_no_torch():
    """`zipmoe --help` and `zipmoe CMD --help` for every registered command run without torch, and
    so do the modules that give the CLI its defaults."""
    code = """
import sys
import typer.main
from zipmoe_cli.app import app, main, register
import zipmoe.machine, zipmoe.runtime.engine.states, zipmoe.runtime.engine.dtypes, zipmoe.runtime.plan.calibrate

register()
names = sorted(c.name for c in typer.main.get_command(app).commands.values())
assert len(names) >= 8, names
for args in [["--help"]] + [[n, "--help"] for n in names]:
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, None), (args, exc.code)
    heavy = sorted(m for m in ("torch", "transformers", "numba", "triton") if m in sys.modules)
    assert not heavy, (args, heavy)
print(" ".join(names))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "analyze" in proc.stdout and "verify" in proc.stdout


if __name__ == "__main__":
    for n, path in module_sizes():
        print(f"{n:6d}  {path}")
