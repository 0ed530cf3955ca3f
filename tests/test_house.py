"""The house rules, checked on the source: modules a newcomer reads in one sitting, no import
cycle, dependencies pointing down, page arithmetic in the allocator alone, and a `state` that
passes through `apply_directives` without going back and forth between modules.

Every rule's checker is also run on a made-up case that breaks it, so none can pass vacuously.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

import leyline_jax as ll
from leyline_jax import kv_pools, kv_state

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "leyline_jax", "checkpoints", "serve", "benchmarks")  # low to high
MAX_FILE = 300  # serve/: a module read in one sitting
MAX_FUNCTION = 80  # outside the kernels
MAX_ENGINE = 250
MAX_RETURNS = 6  # modules `state` comes back to inside apply_directives
# the CLI names `python -m serve.replay` / `serve.traces` kept as shims over the benchmarks
UPWARD_SHIMS = {"serve.replay", "serve.traces"}


def sources() -> dict[str, ast.Module]:
    """Every module of the five packages: dotted name -> its syntax tree."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def long_functions(tree: ast.Module, limit: int) -> list[tuple[str, int]]:
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > limit
    ]


def imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in it (inside functions too), but under
    `if TYPE_CHECKING:`; `from pkg import sub` counts as importing the submodule."""
    skip = {
        id(x)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
        for x in ast.walk(n)
    }
    out = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name in modules}
        elif isinstance(n, ast.ImportFrom) and n.module:
            base = n.module
            for a in n.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def layer(module: str) -> int:
    return PACKAGES.index(module.split(".")[0])


def returns(modules: list[str]) -> int:
    """How often a sequence of modules comes back to one it already left."""
    seen, back, last = set(), 0, None
    for m in modules:
        if m != last:
            back += m in seen
            seen.add(m)
        last = m
    return back


# ---- the rules ---------------------------------------------------------------------------------
def test_serve_modules_are_read_in_one_sitting():
    big = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "serve").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_FILE
    }
    assert not big, big


def test_no_function_is_longer_than_a_screenful_outside_the_kernels():
    long = {
        name: found
        for name, tree in sources().items()
        if not name.startswith("pallas_kernels") and (found := long_functions(tree, MAX_FUNCTION))
    }
    assert not long, long


def test_the_engine_is_a_thin_front():
    tree = sources()["serve.engine"]
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert engine.end_lineno - engine.lineno + 1 <= MAX_ENGINE


def test_no_import_cycle_and_dependencies_point_down():
    trees = sources()
    graph = {name: imports(name, tree, set(trees)) for name, tree in trees.items()}
    assert cycle(graph) is None, cycle(graph)
    upward = sorted(
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if layer(d) > layer(m) and m not in UPWARD_SHIMS
    )
    assert not upward, upward


def test_page_arithmetic_lives_in_the_allocator():
    """The ceiling division is written once, as `allocator.pages_for` (the kernels, which know
    nothing of the package, keep their own tile arithmetic)."""
    found = [
        str(p.relative_to(REPO))
        for pkg in PACKAGES[1:]
        for p in sorted((REPO / pkg).rglob("*.py"))
        for line in p.read_text().splitlines()
        if "-(-" in line
    ]
    assert found == ["leyline_jax/allocator.py"], found


def follow_state(model, directives) -> list[str]:
    """The modules of the calls handed the state or its pools during one warm
    `apply_directives` (the state's own methods are reading it, not passing it on)."""
    kinds = (kv_state.PagedKVState, kv_pools.KVPools)
    root = str(REPO) + os.sep

    def run(trace: bool) -> list[str]:
        state = ll.init_state(model.config, num_pages=64, page_size=16, max_seqs=2)
        state, _ = ll.prefill(model, state, 0, list(range(3, 120)))
        seen: list[str] = []

        def profile(frame, event, arg):
            f, local = frame.f_code.co_filename, frame.f_locals
            if event != "call" or not f.startswith(root) or f.startswith(str(REPO / "tests")):
                return
            if ".venv" in f or isinstance(local.get("self"), kinds):
                return
            if any(isinstance(v, kinds) for v in local.values()):
                seen.append(str(Path(f).relative_to(REPO)))

        if trace:
            sys.setprofile(profile)
        try:
            ll.apply_directives(model, state, 0, directives)
        finally:
            sys.setprofile(None)
        return seen

    run(False)  # compiles: the traced run is the warm one
    return run(True)


def test_state_goes_through_apply_directives_without_going_back(np_ckpt):
    """An AMORTIZE edit before a FORGET one: the state passes through the directives, the
    allocator, the splice and the ragged step, each in turn (measured: 2 returns, from 12
    before the allocator planned a batch's pages once)."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    ds = [ll.Directive(10, 20, (5, 6, 7)), ll.Directive(60, 70, (8,), ll.Mode.FORGET)]
    seen = follow_state(model, ds)
    assert {"leyline_jax/allocator.py", "leyline_jax/splice.py", "leyline_jax/paged.py"} <= set(
        seen
    )
    assert returns(seen) <= MAX_RETURNS, seen


# ---- the checkers can fail ---------------------------------------------------------------------
def test_the_checkers_catch_what_they_are_for():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    tree = ast.parse(f"def f():\n{body}\n    return x0\n\ndef g():\n    return 1\n")
    assert long_functions(tree, MAX_FUNCTION) == [("f", MAX_FUNCTION + 2)]
    hidden = ast.parse("def f():\n    from a.b import c\n")  # an import inside a function
    assert imports("a.x", hidden, {"a.b", "a.b.c", "a.x"}) == {"a.b.c"}
    typing_only = ast.parse("if TYPE_CHECKING:\n    from a.b import c\n")
    assert imports("a.x", typing_only, {"a.b.c"}) == set()
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert returns(["d", "p", "d", "s", "p", "s"]) == 3 and returns(["d", "d", "p"]) == 0


@pytest.mark.parametrize("case", ["cycle", "upward"])
def test_the_import_rules_fail_on_a_broken_graph(case):
    """The repository's graph with one edge added that breaks a rule."""
    trees = sources()
    graph = {name: imports(name, tree, set(trees)) for name, tree in trees.items()}
    if case == "cycle":
        graph["leyline_jax.config"].add("leyline_jax.model")  # model imports config
        assert cycle(graph) is not None
    else:
        graph["leyline_jax.paged"].add("serve.engine")
        assert any(layer(d) > layer(m) for m, deps in graph.items() for d in deps)
