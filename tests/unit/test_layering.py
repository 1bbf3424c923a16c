"""Imports run one way: flows -> tasks -> (trainer, publish) -> ett.

Every module of the package is read (not imported) and each of its import statements, at
any depth (function-level and `TYPE_CHECKING` imports included, relative ones resolved), is
checked against the layers it must not reach. A wrong-way import fails here, naming the file
and line; the last test adds one to a copy of the package to show that it would.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import ettflow

PACKAGE = Path(ettflow.__file__).parent
FORBIDDEN = {  # package -> the ettflow packages it must never import
    "ettflow.ett": ("ettflow.tasks", "ettflow.flows", "ettflow.trainer", "ettflow.publish"),
    "ettflow.trainer": ("ettflow.tasks", "ettflow.flows"),
    "ettflow.publish": ("ettflow.tasks", "ettflow.flows"),
    "ettflow.tasks": ("ettflow.flows",),
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


def test_imports_run_one_way():
    assert violations(PACKAGE) == []


def test_every_layer_is_scanned():
    names = {module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    for pkg in FORBIDDEN:
        assert any(n.startswith(pkg + ".") for n in names), f"{pkg} has no modules: is FORBIDDEN stale?"


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
