"""A package's names that resolve on first use (PEP 562), so importing the package for a light
part of it (a flow's process: checkpoint anchors, compile stats) does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, namespace: dict[str, Any], where: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's module-level `__getattr__`: `where` maps a name to the module defining it;
    the first use imports that module and keeps the value in the package's `namespace`."""

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
