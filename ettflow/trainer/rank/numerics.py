"""Non-finite training state: found cheaply, stopped at once, never saved.

The loss is checked every step, before its backward: it is read to the host once per step
anyway, and a NaN caught there never reaches the gradients' all-reduce, so no peer's
parameters are touched. The dense parameters are checked when a checkpoint or the anchor is
about to be saved: no checkpoint ever holds non-finite dense state. Either finding is a
`numerics` failure (`FailureError`), recorded as the rank's `failure` marker in the spool;
the step it happened at is never recorded as a `train_step`, so it never counts as training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NoReturn

import torch

from ettflow.ett.failures import Failure, FailureClass, FailureError
from ettflow.ett.spool import SpoolWriter

log = logging.getLogger("ettflow.trainer")


def loss_failure(loss: float, *, rank: int, step: int, injected: bool = False) -> Failure | None:
    """A numerics failure when the step's loss is NaN or infinite, else None."""
    if math.isfinite(loss):
        return None
    return Failure(failure_class=FailureClass.NUMERICS, rank=rank, step=step, injected=injected,
                   reason=f"non-finite loss at step {step} on rank {rank}", detail=f"loss={loss}")


def nonfinite_parameters(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (one host sync when all are finite)."""
    if not named:
        return []
    with torch.no_grad():
        flags = torch.stack([torch.isfinite(t).all() for _, t in named])
        if bool(flags.all()):
            return []
        return [name for (name, _), ok in zip(named, flags.tolist()) if not ok]


def parameters_failure(named: Sequence[tuple[str, torch.Tensor]], *, rank: int, step: int,
                       action: str) -> Failure | None:
    """A numerics failure when a dense parameter is non-finite; `action` says what was refused."""
    bad = nonfinite_parameters(named)
    if not bad:
        return None
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return Failure(failure_class=FailureClass.NUMERICS, rank=rank, step=step,
                   reason=f"non-finite dense parameters at step {step} on rank {rank}: {action} refused",
                   detail=f"non-finite: {shown}")


def refuse_nonfinite(rec: SpoolWriter, named: Sequence[tuple[str, torch.Tensor]], *, rank: int, step: int,
                     loss: float | None, action: str) -> None:
    """Before a save: stop with a numerics failure unless `loss` (None: no step trained yet)
    and every dense parameter are finite. `action` names what is refused."""
    failure = loss_failure(loss, rank=rank, step=step) if loss is not None else None
    if failure is not None:
        failure = replace(failure, reason=f"{failure.reason}: {action} refused")
    else:
        failure = parameters_failure(named, rank=rank, step=step, action=action)
    if failure is not None:
        stop(rec, failure)


def stop(rec: SpoolWriter, failure: Failure, **extra: Any) -> NoReturn:
    """Record the rank's failure marker (durably, with `extra` attributes: the scripted
    fault's `fault_index`) and end the attempt with it."""
    log.error("%s; the attempt stops (%s)", failure.summary, failure.detail)
    rec.mark("failure", **failure.to_attrs(), **extra)
    raise FailureError(failure)


def poison(params: Sequence[torch.Tensor]) -> None:
    """The scripted `nan` fault: fill the first dense parameter with NaN, so the next forward
    pass gives a non-finite loss."""
    with torch.no_grad():
        params[0].fill_(float("nan"))
