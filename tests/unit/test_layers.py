"""The import graph of planner/ (issue 21; docs/CONTRACTS.md "Layers"), read with ast: nothing is
imported, so this runs without torch.

Rules:
- the planning side (specs, cost, search, the serving cost model, data, calibrate, ...) never
  imports torch, DeepSpeed, the torch model or the runtime, not even inside a function;
- every import goes down the layer order below or stays inside its own package: no import runs
  back up a layer, and packages of one layer do not import each other;
- no import cycle, neither between packages nor between modules (lazy imports included: a
  function-level import that closes a circle is still a circle);
- nothing imports planner.executor, which is only the compatibility entry of old launch.sh files.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "planner"

LAYERS: list[set[str]] = [
    {"planner", "errors"},
    {"specs"},
    {"rundir", "cost"},
    {"dsconfig", "data", "calibrate"},
    {"serve", "search", "export"},
    {"model", "runtime"},                      # runtime: procs.py, files.py (standard library only)
    {"hf", "profiler"},
    {"runtime.observe"},
    {"runtime.preflight"},
    {"runtime.train", "runtime.serve"},
    {"tune", "ladder"},
    {"report"},
    {"cli"},
    {"__main__", "executor"},
]
"""Bottom to top. A package may import its own modules and any package of a lower layer."""

PLANNING = {"planner", "errors", "specs", "rundir", "cost", "dsconfig", "data", "serve", "calibrate", "search",
            "export"}
"""Pure Python (numpy at most): what `planner search` / `estimate` / `serve` load."""
TORCH_SIDE = {"model", "hf", "runtime", "runtime.observe", "runtime.preflight", "runtime.train", "runtime.serve",
              "executor"}
TORCH_MODULES = {"torch", "deepspeed", "torchvision", "triton"}
RUNTIME_SUBPACKAGES = {"observe", "preflight", "train", "serve"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("planner",) + f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def unit(module: str) -> str:
    """The package a module belongs to for layering: planner.<pkg>, or planner.runtime.<sub>."""
    parts = module.split(".")
    if len(parts) == 1:
        return "planner"
    if parts[1] == "runtime" and len(parts) > 2 and parts[2] in RUNTIME_SUBPACKAGES:
        return f"runtime.{parts[2]}"
    return parts[1]


def _resolve(name: str) -> str:
    """The planner module an imported dotted name lives in (a name inside a module -> the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported dotted name, line) of every import in the file, function-level ones included."""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names] + [(base, node.lineno)]
    return found


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """Module edges inside planner; (module, planner target, line); (module, foreign top-level, line)."""
    edges: dict[str, set[str]] = defaultdict(set)
    internal, external = [], []
    for mod, path in MODULES.items():
        for name, line in _imports(mod, path):
            top = name.split(".")[0]
            if top != "planner":
                external.append((mod, top, line))
                continue
            target = _resolve(name)
            if target and target != mod and not mod.startswith(target + "."):
                edges[mod].add(target)
                internal.append((mod, target, line))
    return edges, internal, external


EDGES, INTERNAL, EXTERNAL = _graph()
LEVEL = {u: i for i, layer in enumerate(LAYERS) for u in layer}


def _where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(ROOT.parent)}:{line}"


def test_every_package_has_a_layer() -> None:
    units = {unit(m) for m in MODULES}
    assert units - set(LEVEL) == set(), "place the new package in LAYERS (and docs/CONTRACTS.md)"
    assert PLANNING | TORCH_SIDE <= set(LEVEL)


def test_the_planning_side_never_imports_torch_or_the_runtime() -> None:
    bad = [f"{_where(m, ln)} imports {top}" for m, top, ln in EXTERNAL
           if unit(m) in PLANNING and top in TORCH_MODULES]
    bad += [f"{_where(m, ln)} imports {t}" for m, t, ln in INTERNAL
            if unit(m) in PLANNING and unit(t) in TORCH_SIDE]
    assert bad == []


def test_no_import_runs_back_up_a_layer() -> None:
    bad = [f"{_where(m, ln)}: {unit(m)} (layer {LEVEL[unit(m)]}) imports {t} (layer {LEVEL[unit(t)]})"
           for m, t, ln in INTERNAL
           if unit(m) != unit(t) and LEVEL[unit(t)] >= LEVEL[unit(m)]]
    assert bad == []


def test_nothing_imports_the_compatibility_entry() -> None:
    assert [_where(m, ln) for m, t, ln in INTERNAL if unit(t) == "executor" and unit(m) != "executor"] == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan 1972), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(set(edges) | {t for ts in edges.values() for t in ts}):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_between_packages_or_modules() -> None:
    packages: dict[str, set[str]] = defaultdict(set)
    for m, ts in EDGES.items():
        packages[unit(m)] |= {unit(t) for t in ts if unit(t) != unit(m)}
    assert _cycles(packages) == []
    # a package importing its own __init__ (planner.cost -> planner.cost.x -> planner.cost) is
    # Python's package loading, not a circle of ours
    modules = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in EDGES.items()}
    assert _cycles(modules) == []


def test_the_checks_can_fail() -> None:
    """The rules see a planted upward import, a torch import and a circle."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert unit("planner.runtime.train.loop") == "runtime.train" and unit("planner.runtime.procs") == "runtime"
    assert unit("planner.cost.model") == "cost" and unit("planner.dsconfig") == "dsconfig"
    assert LEVEL["cost"] < LEVEL["search"] < LEVEL["runtime.train"] < LEVEL["cli"]
    assert ("planner.search.outputs", "torch") not in {(m, t) for m, t, _ in EXTERNAL}
    assert any(unit(m) == "runtime.train" and t == "torch" for m, t, _ in EXTERNAL)
