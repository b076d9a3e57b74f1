"""Mutation testing of the cost model and the search (issue 8): which mutants survive the tests?

mutmut (pinned in requirements.txt) rewrites planner/cost and planner/search one small change
at a time (a number, an operator, a comparison, a dropped argument...) and runs the fast cost
and search unit tests against each mutant. A mutant the tests do not catch ("survived") is
either a test gap or a change that cannot matter; each survivor is listed here, and the
explained ones carry their reason from benchmarks/mutation_explained.json (mutant name ->
{"mutated": the mutated line, "why": ...}; an entry whose line no longer matches is stale and
the mutant counts as unexplained).

The project's pyproject.toml is not touched: the run happens in a work directory holding a
copy of planner/, profiles/, the selected tests and a setup.cfg with the [mutmut] section.

    # run (about 15 min on 2 cores; takes the shared CPU lock), then print the survivors
    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/mutation.py --run
    # print the survivors of the last run (seconds)
    .venv/bin/python benchmarks/mutation.py

A chosen file list (issue 19: the cost files one round touched) runs with the tests that import
them, one core, outside the CPU lock (it is long, not a timing):

    nice -n 10 .venv/bin/python benchmarks/mutation.py --run --children 1 --workdir /tmp/mut-cost \
        --paths planner/cost/compute.py planner/cost/comm.py
    .venv/bin/python benchmarks/mutation.py --workdir /tmp/mut-cost --paths planner/cost/compute.py ...

After new tests, re-check only the unexplained survivors (a fresh work directory, the new test
files named) and count them over the full run (--base, earlier re-checks after it in order):

    .venv/bin/python benchmarks/mutation.py --workdir /tmp/mut-cost --paths ... --write-todo /tmp/todo.json
    nice -n 10 .venv/bin/python benchmarks/mutation.py --run --children 1 --workdir /tmp/mut-re \
        --only /tmp/todo.json --base /tmp/mut-cost --paths ... --tests ...

`--tests` replaces the test files; without it they are TESTS plus every tests/unit file that
imports one of the chosen modules. The printout counts only the mutants
of the chosen files.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPLAINED = Path(__file__).with_name("mutation_explained.json")
WORKDIR = Path(os.environ.get("PLANNER_MUTATION_DIR", "/tmp/planner-mutation"))
MUTATE = ["planner/cost/*", "planner/search/*", "planner/serve/*"]
TESTS = ["tests/unit/test_cost_terms.py", "tests/unit/test_cost_activations.py", "tests/unit/test_cost_runtime.py",
         "tests/unit/test_cost_units.py", "tests/unit/test_cost_published.py", "tests/unit/test_cost_behaviour.py",
         "tests/unit/test_cost_zero.py", "tests/unit/test_search.py", "tests/unit/test_search_units.py",
         "tests/unit/test_variant_terms.py", "tests/unit/test_serve_cost.py", "tests/unit/test_serve_queue.py",
         "tests/unit/test_serve_calibrate.py"]
DESELECT = ("not study_resumes and not cost_model_imports_no_heavy_libraries "
            "and not (a_fraction_of_the_shapes and glm130b)")
"""Left out of the mutation runs: a resumable Optuna study on SQLite and Optuna on GLM-130B's
space (2-3 s each; the same code is covered by the GLM-10B Optuna case), and a subprocess
import check (mutmut's trampolines import mutmut itself)."""
NO_MUTATE_LINES = [r"^\s*(name|source)=", r"^\s+f?\"[^\"]*\"\)*,?\s*$", r"^(ENGINE_SRC|SRC_\w+) = "]
"""Lines mutmut leaves alone: the engines' names and DeepSpeed citations, and string-only
continuation lines of messages (changing their text cannot change a number)."""
NOT_MUTATED = ["planner/search/trials.py", "planner/search/driver.py", "planner/search/outputs.py",
               "planner/serve/outputs.py"]
"""CSV and run-directory writing and the search driver's plumbing are exercised by the CLI tests (not run
per mutant)."""

SLOW_FOR_PATHS = ["search_run_directory_holds_base_beside_variant"]
"""Deselected in --paths runs: a whole search writing its run directory (12 s per mutant that reaches
it); the terms it reads are pinned by the cost tests."""
def module_of(path: str) -> str:
    """planner/cost/comm.py -> planner.cost.comm"""
    return ".".join(Path(path).with_suffix("").parts)


def tests_importing(paths: list[str]) -> list[str]:
    """TESTS plus every tests/unit file importing one of the modules at `paths` (as
    `planner.cost.comm` or `from planner.cost import comm`)."""
    found = list(TESTS)
    for path in paths:
        mod = module_of(path)
        pkg, _, leaf = mod.rpartition(".")
        pat = re.compile(rf"\b{re.escape(mod)}\b|from {re.escape(pkg)} import [^\n]*\b{re.escape(leaf)}\b")
        for test in sorted((ROOT / "tests" / "unit").glob("test_*.py")):
            rel = str(test.relative_to(ROOT))
            if rel not in found and pat.search(test.read_text()):
                found.append(rel)
    return found


def check_paths(paths: list[str]) -> str | None:
    """One line naming the bad --paths entry and the fix, or None."""
    for path in paths:
        if not path.endswith(".py") or not (ROOT / path).is_file():
            return f"--paths {path}: not a Python file under the repository; give paths like planner/cost/comm.py"
        if not path.startswith(("planner/cost/", "planner/search/", "planner/serve/")):
            return (f"--paths {path}: the mutation run covers planner/cost, planner/search and planner/serve; "
                    "give a file there")
    return None


CONFTEST = '''

import sys as _sys

import pytest as _pytest


@_pytest.fixture(autouse=True)
def _fresh_caches():
    """mutmut forks every mutant from a process that already ran the tests: empty the cost
    model's lru_caches first, or a mutant would be served the original code's results."""
    for name, mod in list(_sys.modules.items()):
        if name.startswith(("planner.cost", "planner.search")) or ".planner.cost" in name:
            for value in list(vars(mod).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
    yield
'''

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 35: "suspicious",
          36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          -11: "segfault", -9: "segfault", None: "not checked", 2: "interrupted"}


CACHE_DECORATOR = re.compile(r"^@(functools\.)?(lru_cache|cache)(\(.*\))?[ \t]*\n", re.M)


def undecorate(work: Path, mutate: list[str]) -> int:
    """Drop the module-level @lru_cache / @cache lines of the files to mutate, in the work copy:
    mutmut 3.8.1 leaves decorated functions unmutated, and these caches only save time (the
    conftest empties them between tests anyway). Returns how many were dropped."""
    n = 0
    for pattern in mutate:
        for path in work.glob(pattern):
            if path.suffix == ".py":
                text, k = CACHE_DECORATOR.subn("", path.read_text())
                if k:
                    path.write_text(text)
                    n += k
    return n


def prepare(work: Path, mutate: list[str], tests: list[str], deselect: str, uncache: bool = False) -> None:
    """A fresh copy of the sources and tests with the [mutmut] configuration."""
    if work.exists():
        shutil.rmtree(work)
    (work / "tests" / "unit").mkdir(parents=True)
    shutil.copytree(ROOT / "planner", work / "planner", ignore=shutil.ignore_patterns("__pycache__"))
    if uncache:
        print(f"cached functions made mutable: {undecorate(work, mutate)}")
    shutil.copytree(ROOT / "profiles", work / "profiles")
    for t in tests:
        shutil.copy(ROOT / t, work / t)
    for extra in ("tests/__init__.py", "tests/unit/__init__.py", "tests/conftest.py", "tests/unit/conftest.py"):
        if (ROOT / extra).exists():
            shutil.copy(ROOT / extra, work / extra)
    with open(work / "tests" / "conftest.py", "a") as fh:
        fh.write(CONFTEST)
    lines = ["[mutmut]", "source_paths=planner", "also_copy=profiles",
             "only_mutate=" + "\n    ".join(mutate),
             "do_not_mutate=" + "\n    ".join(NOT_MUTATED),
             "do_not_mutate_patterns=" + "\n    ".join(NO_MUTATE_LINES),
             "pytest_add_cli_args_test_selection=" + "\n    ".join(tests + ["-k", deselect]),
             "pytest_add_cli_args=-p\n    no:cacheprovider",
             "timeout_multiplier=5.0", "timeout_constant=5.0"]
    (work / "setup.cfg").write_text("\n".join(lines) + "\n")


def run(work: Path, children: int, timeout: float, only: list[str] | None = None) -> int:
    env = dict(os.environ, PYTHONPATH=str(work), DS_ACCELERATOR="cpu")
    mutmut = [str(Path(sys.executable).with_name("mutmut"))]
    t0 = time.time()
    proc = subprocess.run(mutmut + ["run", "--max-children", str(children)] + list(only or []), cwd=work, env=env, timeout=timeout,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    print(f"mutmut run: exit {proc.returncode} in {time.time() - t0:.0f} s")
    if proc.returncode:
        print(proc.stderr[-3000:])
    return proc.returncode


def ran_tests(work: Path) -> list[str] | None:
    """The test files the work directory's setup.cfg selected (None without one)."""
    cfg = work / "setup.cfg"
    if not cfg.exists():
        return None
    m = re.search(r"pytest_add_cli_args_test_selection=(.*?)\n\s+-k\n", cfg.read_text(), re.S)
    return [t.strip() for t in m.group(1).split("\n") if t.strip()] if m else None


def results(work: Path) -> dict[str, str]:
    """Mutant name -> status, from mutmut's .meta files."""
    out: dict[str, str] = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        for name, code in data["exit_code_by_key"].items():
            out[name] = STATUS.get(code, "suspicious")
    return out


def mutated_lines(work: Path) -> dict[str, tuple[str, str]]:
    """Mutant name -> (original line(s), mutated line(s)), read from the mutated sources mutmut
    writes (each mutant is a copy of its function, `<function>__mutmut_<n>`, beside
    `<function>__mutmut_orig`)."""
    out: dict[str, tuple[str, str]] = {}
    for src in sorted((work / "mutants" / "planner").rglob("*.py")):
        text = src.read_text()
        if "__mutmut_orig" not in text:
            continue
        rows = text.splitlines()
        funcs = {node.name: "\n".join(rows[node.lineno - 1:node.end_lineno]) for node in ast.walk(ast.parse(text))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        module = ".".join(src.relative_to(work / "mutants").with_suffix("").parts)
        for name, body in funcs.items():
            m = re.fullmatch(r"(.*)__mutmut_(\d+)", name)
            if not m or m.group(2) == "orig":
                continue
            orig = funcs.get(m.group(1) + "__mutmut_orig")
            if orig is None:
                continue
            a = orig.replace(m.group(1) + "__mutmut_orig", "F").splitlines()
            b = body.replace(name, "F").splitlines()
            diff = list(difflib.unified_diff(a, b, lineterm="", n=0))
            minus = [ln[1:].strip() for ln in diff if ln.startswith("-") and not ln.startswith("---")]
            plus = [ln[1:].strip() for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
            out[f"{module}.{name}"] = (" | ".join(minus), " | ".join(plus))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="prepare the work directory and run mutmut (long)")
    ap.add_argument("--children", type=int, default=2)
    ap.add_argument("--resume", action="store_true",
                    help="run mutmut again in the existing work directory: only the mutants not yet checked")
    ap.add_argument("--timeout", type=float, default=5400.0, help="seconds for the whole mutmut run")
    ap.add_argument("--workdir", type=Path, default=WORKDIR)
    ap.add_argument("--paths", nargs="+", default=None,
                    help="mutate only these files (e.g. planner/cost/comm.py); default: " + " ".join(MUTATE))
    ap.add_argument("--tests", nargs="+", default=None,
                    help="the test files to run per mutant; default with --paths: TESTS plus the tests/unit files "
                         "that import a chosen module")
    ap.add_argument("--only", nargs="+", default=None,
                    help="with --run: check only these mutants (names, or a JSON file whose keys are names, such as "
                         "--write-todo's): the re-check after new tests")
    ap.add_argument("--base", type=Path, nargs="+", default=None,
                    help="the work directory of an earlier full run (then of earlier re-checks, in order): its "
                         "results, overridden by the mutants each later directory and this one checked (the "
                         "counts after --only re-checks)")
    ap.add_argument("--uncache", action="store_true",
                    help="with --run: drop @lru_cache/@cache from the files to mutate (mutmut skips decorated functions)")
    ap.add_argument("--write-todo", type=Path, default=None,
                    help="write the unexplained survivors as a JSON skeleton to fill in")
    args = ap.parse_args()
    work = args.workdir
    mutate, tests, deselect = MUTATE, TESTS, DESELECT
    if args.paths:
        err = check_paths(args.paths)
        if err:
            print(err, file=sys.stderr)
            return 2
        mutate = list(args.paths)
        tests = list(args.tests) if args.tests else tests_importing(args.paths)
        deselect = DESELECT + " and not " + " and not ".join(SLOW_FOR_PATHS)
    elif args.tests:
        tests = list(args.tests)
    missing = [t for t in tests if not (ROOT / t).is_file()]
    if missing:
        print(f"--tests {missing[0]}: no such test file; give paths like tests/unit/test_cost_units.py",
              file=sys.stderr)
        return 2
    if args.run:
        prepare(work, mutate, tests, deselect, uncache=args.uncache)
    only = None
    if args.only:
        only = []
        for item in args.only:
            only += list(json.loads(Path(item).read_text())) if item.endswith(".json") else [item]
    if args.run or args.resume:
        run(work, args.children, args.timeout, only)
    if not (work / "mutants").exists():
        print(f"no mutmut results in {work}: run with --run first")
        return 0
    status = results(work)
    if args.base:
        merged = results(args.base[0])
        for layer in [*args.base[1:], work]:
            checked = {n: st for n, st in (status if layer == work else results(layer)).items() if st != "not checked"}
            merged.update(checked)
            print(f"{len(checked)} mutants re-checked in {layer}")
        print(f"over the results of {args.base[0]}")
        status = merged
    if args.paths:
        chosen = {module_of(p) for p in args.paths}
        status = {n: s for n, s in status.items() if n.rsplit(".", 1)[0] in chosen}
    explained = json.loads(EXPLAINED.read_text()) if EXPLAINED.exists() else {}
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    # a mutant that makes the tests hang is caught (CI would time out): only these need a word
    survivors = sorted(n for n, s in status.items() if s in ("survived", "no tests", "suspicious"))
    ok, todo, stale = [], [], []
    lines = mutated_lines(work)
    for name in survivors:
        before, after = lines.get(name, ("?", "?"))
        entry = explained.get(name)
        if entry and entry.get("mutated") == after:
            ok.append((name, status[name], after, entry["why"]))
        else:
            (stale if entry else todo).append((name, status[name], before, after))
    ran = ran_tests(work)
    if ran is not None:  # the files this work directory's run used, not today's defaults
        tests = ran
    print(f"mutants: {len(status)} in {', '.join(mutate)} (tests: {len(tests)} files, -k '{deselect}')")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
    print(f"surviving: {len(survivors)}; explained: {len(ok)}; unexplained: {len(todo) + len(stale)}")
    for name, st, after, why in ok:
        print(f"  [explained] {name} ({st}): {after}\n      why: {why}")
    for name, st, before, after in todo + stale:
        print(f"  [UNEXPLAINED{' (stale)' if (name, st, before, after) in stale else ''}] {name} ({st})\n"
              f"      - {before}\n      + {after}")
    if args.write_todo:
        args.write_todo.write_text(json.dumps({n: {"mutated": a, "why": ""} for n, _, _, a in todo + stale},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
