"""Imports run one way: cli -> bench -> stack -> flows -> tasks -> (trainer, publish) -> ett, and no
module imports another that imports it back, however long the way round.

Every module of the package is read (not imported) and each of its import statements, at
any depth (function-level and `TYPE_CHECKING` imports included, relative ones resolved), is
checked against the layers it must not reach, and the graph of those imports is searched for
circles. A wrong-way import fails here, naming the file and line, and a circle naming its
modules; the probe tests add one to a copy of the package to show that it would.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import ettflow

PACKAGE = Path(ettflow.__file__).parent
CLI = "ettflow.cli"  # the `ettflow` command: only `python -m ettflow` (ettflow/__main__.py) imports it
FORBIDDEN = {  # package (or module) -> the ettflow packages it must never import
    "ettflow.ett": ("ettflow.stack", "ettflow.tasks", "ettflow.flows", "ettflow.trainer", "ettflow.publish",
                    "ettflow.bench", CLI),
    # the trainer's two sides never import each other (what crosses is `trainer/protocol.py`'s;
    # the rank's actor class is passed to the driver's side by who composes them), and what they
    # share imports neither
    "ettflow.trainer.group": ("ettflow.trainer.rank", "ettflow.stack", "ettflow.tasks", "ettflow.flows",
                              "ettflow.bench", CLI),
    "ettflow.trainer.rank": ("ettflow.trainer.group", "ettflow.stack", "ettflow.tasks", "ettflow.flows",
                             "ettflow.bench", CLI),
    "ettflow.trainer": ("ettflow.trainer.group", "ettflow.trainer.rank", "ettflow.stack", "ettflow.tasks",
                        "ettflow.flows", "ettflow.bench", CLI),
    "ettflow.publish": ("ettflow.stack", "ettflow.tasks", "ettflow.flows", "ettflow.bench", CLI),
    "ettflow.tasks": ("ettflow.stack", "ettflow.flows", "ettflow.bench", CLI),
    "ettflow.flows": ("ettflow.stack", "ettflow.bench", CLI),
    "ettflow.stack": ("ettflow.bench", CLI),
    "ettflow.bench": (CLI,),
    "ettflow.console": (CLI,),
    "ettflow.paths": (CLI,),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[int, set[str]]]:
    """(line, the absolute module names it may import) for every import statement in the file."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, set[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.append((node.lineno, {alias.name for alias in node.names}))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from ettflow import flows` imports the module ettflow.flows: the names count too
            out.append((node.lineno, {target} | {f"{target}.{a.name}" for a in node.names}))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        banned = next((b for pkg, b in FORBIDDEN.items() if name == pkg or name.startswith(pkg + ".")), ())
        for line, targets in imports(path, root):
            bad = sorted(t for t in targets for b in banned if t == b or t.startswith(b + "."))
            if bad:
                found.append(f"{path.relative_to(root.parent)}:{line} ({name}) imports {bad[0]}")
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (a name resolves to the
    longest module it names: `from .x import f` is module x, `from . import x` too). A module's
    own packages are left out: importing `a.b.c` runs `a/b/__init__.py`, which is not a circle."""
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        deps = set()
        for _, targets in imports(path, root):
            for target in targets:
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                found = ".".join(parts)
                if found and found != name and not name.startswith(found + "."):
                    deps.add(found)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_imports_run_one_way():
    assert violations(PACKAGE) == []


def test_no_module_imports_itself_back():
    assert circles(import_graph(PACKAGE)) == []


def test_circles_are_found_however_long():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "e2"]]


@pytest.mark.parametrize(
    ("files", "circle"),
    [
        ({"tasks/x_probe_a.py": "from . import x_probe_b\n", "tasks/x_probe_b.py": "from .x_probe_a import f\n"},
         ["ettflow.tasks.x_probe_a", "ettflow.tasks.x_probe_b"]),
        ({"trainer/x_probe_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x_probe_b import B\n",
          "trainer/x_probe_b.py": "def f():\n    from ettflow.trainer import x_probe_a\n"},
         ["ettflow.trainer.x_probe_a", "ettflow.trainer.x_probe_b"]),
    ],
)
def test_a_circle_is_caught(tmp_path, files, circle):
    root = tmp_path / "ettflow"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    for where, source in files.items():
        (root / where).write_text(source)
    assert circles(import_graph(root)) == [circle]


def test_every_layer_is_scanned():
    names = {module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    for pkg in FORBIDDEN:
        assert any(n == pkg or n.startswith(pkg + ".") for n in names), f"{pkg} has no modules: is FORBIDDEN stale?"


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("trainer/x_layering_probe.py", "def f():\n    from ettflow.tasks.plan import RefreshPlan\n"),
        ("trainer/checkpoint/x_layering_probe.py", "from ...flows import refresh\n"),
        ("publish/x_layering_probe.py", "import ettflow.flows.refresh\n"),
        ("ett/x_layering_probe.py", "from ..tasks import archive\n"),
        ("ett/x_layering_probe.py", "from ettflow.trainer.config import TrainerConfig\n"),
        ("tasks/x_layering_probe.py", "from ettflow import flows\n"),
        ("tasks/x_layering_probe.py", "if True:\n    def f():\n        from ..flows.refresh import refresh_model\n"),
        ("flows/x_layering_probe.py", "def f():\n    from ettflow.cli import main\n"),
        ("bench/x_layering_probe.py", "from ettflow import cli\n"),
        ("trainer/x_layering_probe.py", "from ettflow.bench import jobs\n"),
        ("trainer/rank/x_layering_probe.py", "from ettflow.trainer.group.driver import TrainingDriver\n"),
        ("trainer/data/x_layering_probe.py", "def f():\n    from ..rank import loop\n"),
        ("trainer/x_layering_probe.py", "from .group import driver\n"),
        ("trainer/group/x_layering_probe.py", "def f():\n    from ettflow.trainer.rank.actor import TrainerActor\n"),
    ],
)
def test_a_wrong_way_import_is_caught(tmp_path, where, source):
    root = tmp_path / "ettflow"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / where).write_text(source)
    found = violations(root)
    assert len(found) == 1 and "x_layering_probe.py" in found[0], found


def test_imports_the_right_way_pass(tmp_path):
    root = tmp_path / "ettflow"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tasks" / "x_layering_probe.py").write_text("from ..trainer import config\nfrom ettflow import ett\n")
    (root / "flows" / "x_layering_probe.py").write_text("from ettflow.tasks import plan\n")
    assert violations(root) == []

