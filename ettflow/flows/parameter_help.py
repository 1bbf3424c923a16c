"""The help of every `refresh_model` parameter, as the deployment's run form shows it, derived
from the parameter model (`tasks.parameters.RefreshParameters`).

Prefect 3.9.1 builds a deployment's parameter schema (`prefect.utilities.callables.
parameter_schema`) from the flow function's signature: a section model becomes a `$ref` to its
definition, whose fields keep their pydantic `description`, limits (`minimum`, `pattern`,
`enum`) and types (a switch is a boolean toggle); the form shows each section as a group. A
top-level parameter's own description comes from the ``Args:`` section of the docstring
(Google style), which overrides a `Field`'s there: `with_parameter_help` writes that section
from the model (a section's docstring, a field's description) before the flow is made, and
refuses a flow whose signature differs from the model's fields, so the form, the CLI and the
flow cannot disagree.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import TypeVar

from ettflow.tasks.parameters import RefreshParameters, field_help

F = TypeVar("F", bound=Callable)


def args_section(names: list[str]) -> str:
    """The docstring's ``Args:`` section, one entry per top-level parameter, continuation lines indented."""
    lines = ["Args:"]
    for name in names:
        first, *rest = field_help(name).splitlines()
        lines.append(f"    {name}: {first}")
        lines += [textwrap.indent(line, " " * 8) if line.strip() else "" for line in rest]
    return "\n".join(lines)


def with_parameter_help(fn: F) -> F:
    """Append the ``Args:`` section of `fn`'s parameters to its docstring (before `@flow`),
    once its parameters are checked to be the model's fields, in order, with its defaults."""
    signature = inspect.signature(fn).parameters
    fields = RefreshParameters.model_fields
    if list(signature) != list(fields):
        raise TypeError(f"{fn.__name__}: its parameters {list(signature)} must be RefreshParameters' fields "
                        f"{list(fields)} (ettflow/tasks/parameters.py), in that order")
    defaults = RefreshParameters()
    wrong = [n for n, p in signature.items() if p.default != getattr(defaults, n)]
    if wrong:
        raise TypeError(f"{fn.__name__}: the defaults of {wrong} differ from RefreshParameters'")
    fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{args_section(list(signature))}\n"
    return fn
