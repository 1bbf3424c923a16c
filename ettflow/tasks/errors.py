"""Errors of a refresh's parameters (a module of its own: light to import for the hooks)."""

from __future__ import annotations


class ParameterError(ValueError):
    """A refresh parameter that cannot run; the message names it (`parameter` holds the name)."""

    explained = True  # its message says everything: shown without a traceback (`ettflow.console`)

    def __init__(self, name: str, problem: str) -> None:
        self.parameter = name
        super().__init__(f"parameter {name!r} {problem}")
