"""The package's layout is its data path, and imports only go down it (docs/architecture.md)."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "spap_lib"
# Bottom to top. The foundation (errors, argument checks, atomic files) serves every layer; ``api`` (``sl.prune``)
# sits between evaluation and the artifact layer, whose grid runs prunes; the entry points above may import all.
# keys: the content digests every cache is keyed by; settings: a prune's settings, plain data
FOUNDATION = ("errors", "checks", "files", "keys", "settings")
LAYERS = ("numerics", "model", "methods", "pipeline", "evaluation", "heal", "api", "artifact")
# pricing: the plan's memory and time model; run: a prune's steps, which cli and 02 both take
ENTRY = ("validate", "plan", "pricing", "cli", "nbparams", "run")


def _rank(module: str) -> int | None:
    """A module's layer: -1 for the foundation, the index in LAYERS, len(LAYERS) for an entry point."""
    top = module.split(".")[1] if "." in module else None
    if top in FOUNDATION:
        return -1
    if top in LAYERS:
        return LAYERS.index(top)
    return len(LAYERS) if top in ENTRY or top is None else None


def _imports(tree: ast.Module):
    """Every ``spap_lib`` module imported, at any depth: in a function, and under ``if TYPE_CHECKING:`` too (an
    annotation's import is still an arrow of the graph)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spap_lib"):
            if node.module == "spap_lib":
                yield from ((node.lineno, f"spap_lib.{a.name}") for a in node.names)
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("spap_lib"))


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        yield path, ".".join(p for p in parts if p != "__init__")


def test_every_module_belongs_to_a_layer():
    """A new top-level module is a decision (the layout is the data path), not an accident."""
    stray = [name for _, name in _modules() if name != "spap_lib" and _rank(name) is None]
    assert not stray, f"{stray}: put them in a layer package, or add them to FOUNDATION/LAYERS/ENTRY with a reason"


@pytest.mark.parametrize("path,name", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_only_go_down_the_data_path(path, name):
    """Methods never import the pipeline or what a run leaves behind; nothing imports a layer above its own."""
    if name == "spap_lib":
        return
    up = _upward(name, path.read_text())
    assert not up, up


def _upward(name: str, source: str) -> list[str]:
    own = _rank(name)
    return [f"{name}:{line} imports {target}" for line, target in _imports(ast.parse(source))
            if (rank := _rank(target)) is not None and rank > own]


def test_the_rule_finds_an_upward_import_even_inside_a_function():
    """Not vacuous: a method importing the pipeline is found, in a function and under TYPE_CHECKING too."""
    lazy = "def f():\n    from spap_lib.pipeline.sequential import prune_model\n"
    typing = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spap_lib.model.adapters import MLP\n"
    assert _upward("spap_lib.methods.x", lazy) == ["spap_lib.methods.x:2 imports spap_lib.pipeline.sequential"]
    assert _upward("spap_lib.numerics.x", typing) == ["spap_lib.numerics.x:3 imports spap_lib.model.adapters"]
    assert _upward("spap_lib.numerics.x", "from spap_lib import api\n") == [
        "spap_lib.numerics.x:1 imports spap_lib.api"]


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's name stands for its ``__init__``)."""
    names = {name for _, name in _modules()}
    graph = {}
    for path, name in _modules():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spap_lib"):
                # ``from spap_lib.x import y`` imports module spap_lib.x.y where there is one, else from spap_lib.x
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other_even_through_others():
    """The import graph has no circle: a package's ``__init__`` that imports its modules is not one (they never
    import it back)."""
    assert not _circles(_graph())


def test_the_circle_rule_finds_a_circle_of_three():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


# No exception: the entry points (``sl.prune``, ``sl.check_run``, ``sl.plan``) take their settings as keywords that
# a dataclass declares (``**settings``), and everything below them passes settings as objects
# (docs/architecture.md).
LIMITS = {"parameters": 8, "function lines": 80, "module lines": 400}


def _shape_problems(name: str, source: str) -> list[str]:
    """What breaks the size rules in one module: too many lines, a function too long or with too many parameters
    (``self``/``cls`` not counted; ``*args``/``**kwargs`` count one each)."""
    problems = []
    if source.count("\n") > LIMITS["module lines"]:
        problems.append(f"{name}: {source.count(chr(10))} lines")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
        count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
        if count > LIMITS["parameters"]:
            problems.append(f"{name}.{node.name}: {count} parameters")
        if node.end_lineno - node.lineno + 1 > LIMITS["function lines"]:
            problems.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return problems


def test_modules_and_functions_stay_small_and_settings_travel_as_objects():
    problems = [p for path, name in _modules() for p in _shape_problems(name, path.read_text())]
    assert not problems, problems


def test_the_size_rule_finds_a_long_parameter_list_and_a_long_function_anywhere():
    many = "def f(a, b, c, d, e, f, g, h, *rest):\n    pass\n"
    long = "def g(self):\n" + "    x = 1\n" * 80
    assert _shape_problems("spap_lib.x", many) == ["spap_lib.x.f: 9 parameters"]
    assert _shape_problems("spap_lib.x", long) == ["spap_lib.x.g: 81 lines"]
    assert _shape_problems("spap_lib.plan", "def plan(" + ", ".join("abcdefghij") + "):\n    pass\n") == [
        "spap_lib.plan.plan: 10 parameters"]
