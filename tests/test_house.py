"""The house rules, checked on the source: no import cycle, dependencies pointing down, page
arithmetic in the allocator alone, and a `state` that passes through `apply_directives` without
going back and forth between modules. Every rule's checker is also run on a made-up case that
breaks it, so none can pass vacuously.

Sizes are reported, not gated (docs/testing.md, "The house rules"): `pytest -rP
tests/test_house.py -k sizes` lists the longest modules and functions and the engine's class.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

import leyline_jax as ll
from leyline_jax import kv_pools, kv_state

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "leyline_jax", "checkpoints", "serve", "benchmarks")  # low to high
MAX_RETURNS = 6  # modules `state` comes back to inside apply_directives
LISTED = 8  # how many of the longest modules and functions the size report lists


def sources() -> dict[str, ast.Module]:
    """Every module of the five packages: dotted name -> its syntax tree."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def functions(tree: ast.Module) -> list[tuple[int, str]]:
    """(lines, name) of every function and method in `tree`."""
    return [
        (n.end_lineno - n.lineno + 1, n.name)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in it (inside functions and under `if
    TYPE_CHECKING:` too); `from pkg import sub` counts as importing the submodule."""
    out = set()
    for n in ast.walk(tree):
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


# ---- sizes: reported ---------------------------------------------------------------------------
def test_sizes_are_reported(record_property):
    """The longest modules and functions (the kernels' functions aside) and the engine's class,
    in lines: printed (`-rP` shows them) and recorded as properties (JUnit XML)."""
    trees = sources()
    paths = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = sorted((len(p.read_text().splitlines()), str(p.relative_to(REPO))) for p in paths)
    funcs = sorted(
        (n, f"{name}.{f}")
        for name, tree in trees.items()
        if not name.startswith("pallas_kernels")
        for n, f in functions(tree)
    )
    (engine,) = [n for n in trees["serve.engine"].body if getattr(n, "name", "") == "Engine"]
    report = {
        "longest modules": modules[::-1][:LISTED],
        "longest functions": funcs[::-1][:LISTED],
        "Engine class": engine.end_lineno - engine.lineno + 1,
    }
    for key, value in report.items():
        record_property(key, value)
        print(f"{key}: {value}")
    assert len(modules) == len(trees) and funcs


# ---- the rules ---------------------------------------------------------------------------------
def test_no_import_cycle_and_dependencies_point_down():
    trees = sources()
    graph = {name: imports(name, tree, set(trees)) for name, tree in trees.items()}
    assert cycle(graph) is None, cycle(graph)
    upward = sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))
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
    body = "\n".join(f"    x{i} = {i}" for i in range(9))
    tree = ast.parse(f"def f():\n{body}\n    return x0\n\ndef g():\n    return 1\n")
    assert functions(tree) == [(11, "f"), (2, "g")]
    hidden = ast.parse("def f():\n    from a.b import c\n")  # an import inside a function
    assert imports("a.x", hidden, {"a.b", "a.b.c", "a.x"}) == {"a.b.c"}
    typing_only = ast.parse("if TYPE_CHECKING:\n    from a.b import c\n")
    assert imports("a.x", typing_only, {"a.b.c"}) == {"a.b.c"}
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


# ---- the design's code map lists every module ------------------------------------------------
def code_map(text: str) -> dict[str, set[str]]:
    """docs/design.md's "Code map": folder -> the names in backticks on its lines (a folder
    heads its block as `` `serve/engine/` ``; a bullet opening with `` `sub/` `` lists that
    subfolder's modules)."""
    section = text.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    folder = target = None
    for line in section.splitlines():
        head = re.fullmatch(r"`([\w/]+/)`", line.strip())
        if head:
            folder = target = head.group(1)
            out.setdefault(folder, set())
            continue
        names = re.findall(r"`([^`]+)`", line)
        if folder is None:
            continue
        if line.startswith("- "):
            target = folder + names[0] if names and names[0].endswith("/") else folder
            out.setdefault(target, set())
        out[target] |= set(names)
    return out


def unlisted(mapped: dict[str, set[str]], modules: list[Path]) -> list[str]:
    """Modules (paths relative to the repository) the map does not name in their folder's
    block; an `__init__.py` holding only a docstring need not be named."""
    out = []
    for p in modules:
        rel = p.relative_to(REPO)
        folder = rel.parent.as_posix() + "/"
        tree = ast.parse(p.read_text())
        bare = p.name == "__init__.py" and all(
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in tree.body
        )
        names = mapped.get(folder, set())
        if not bare and p.stem not in names and p.name not in names:
            out.append(rel.as_posix())
    return out


def modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]


def test_the_code_map_lists_every_module():
    mapped = code_map((REPO / "docs" / "design.md").read_text())
    assert unlisted(mapped, modules()) == []
    gone = [f + n for f, names in mapped.items() for n in names
            if n.endswith(".py") and not (REPO / f / n).is_file()]  # fmt: skip
    assert gone == []


def test_the_code_map_check_fails_on_an_unlisted_module(tmp_path):
    text = (REPO / "docs" / "design.md").read_text()
    assert "- `batch.py`:" in text
    cut = "\n".join(x for x in text.splitlines() if not x.startswith("- `batch.py`:"))
    assert unlisted(code_map(cut), modules()) == ["serve/engine/batch.py"]
