"""From an exception to a typed `Failure`: by the exception's type, never by its message.

The mapping (first match wins):

    FailureError                          its own failure (a rank or a task said what it was)
    RayTaskError                          the mapping of its `cause` (the exception the rank raised)
    RayActorError                         infrastructure: the rank's process died (killed, crashed, node lost);
                                          when the cluster lists the rank's node as dead, `on_lost_node`
                                          names the node (ray_group.py asks Ray, never the message)
    DataError                             data: a file broke the schema (its path in the failure)
    OSError ENOSPC / EIO / EDQUOT / EROFS  storage (the file's path in the failure)
    torch DistError (Backend, Network)    infrastructure, secondary: a collective lost its peer
    any other Ray error, ConnectionError,
    TimeoutError                          infrastructure (the cluster, not the code)
    SystemExit, KeyboardInterrupt, a
    BaseException carrying an int `signal`
    (Prefect's TerminationSignal)         preemption: the process running the run was told to stop
                                          (SIGTERM of `ettflow refresh`, a CI runner's timeout, Ctrl-C)
    anything else                         user: a bug in model or training code

Gloo (torch 2.13) reports a lost peer as a plain RuntimeError: it maps to user, and the
driver's preference for a dead process (`primary_failure`, with the grace period in which it
waits for one) keeps the attempt's class right.

Pure apart from importing Ray and torch lazily to know their exception types.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import replace

from ettflow.ett.failures import Failure, FailureClass, FailureError

from .data.schema import DataError

# each storage fault, with what to do about it (in the failure's reason, beside the path)
STORAGE_ADVICE = {
    errno.ENOSPC: "free space on that file system, or point work_root at one with room",
    errno.EDQUOT: "the user's disk quota is used up: raise it or free space, or point work_root elsewhere",
    errno.EROFS: "the file system is read-only: remount it read-write, or point work_root at a writable folder",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg, the storage service), or move work_root",
}
STORAGE_ERRNOS = frozenset(STORAGE_ADVICE)


def failure_from_exception(exc: BaseException, *, rank: int = -1, attempt: int | None = None,
                           step: int | None = None) -> Failure:
    """The failure an exception stands for, on `rank` (-1: the driver or a task) in `attempt`."""
    typed = _typed(exc, rank)
    return replace(typed, rank=typed.rank if typed.rank >= 0 else rank,
                   attempt=typed.attempt if typed.attempt is not None else attempt,
                   step=typed.step if typed.step is not None else step)


def stop_signal(exc: BaseException) -> str | None:
    """The stop a BaseException stands for (`SIGTERM`, `SIGINT`, `exit`), None for an error."""
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(exc, SystemExit):
        return "exit"
    number = getattr(exc, "signal", None)
    if not isinstance(exc, Exception) and isinstance(number, int) and not isinstance(number, bool):
        import signal

        try:
            return signal.Signals(number).name
        except ValueError:
            return f"signal {number}"
    return None


def _typed(exc: BaseException, rank: int) -> Failure:
    stopped = stop_signal(exc)
    if stopped is not None:  # never a bug in the training code: the process was stopped (issue 26 #4)
        return _failure(FailureClass.PREEMPTION, rank, f"the process running the refresh was stopped ({stopped}): "
                        "preempted", exc)
    ray_task, ray_actor, ray_any = _ray_types()
    if isinstance(exc, ray_task):  # first: what `ray.get` raises also subclasses the cause's type
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and cause is not exc:
            return _typed(cause, rank)
        return _failure(FailureClass.USER, rank, f"{type(exc).__name__}", exc)
    if isinstance(exc, FailureError):
        return exc.failure
    if isinstance(exc, ray_actor):
        return _failure(FailureClass.INFRASTRUCTURE, rank, "process died", exc)
    if isinstance(exc, DataError):
        return _failure(FailureClass.DATA, rank, str(exc), exc, path=exc.file)
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        path = None if exc.filename is None else str(exc.filename)
        what = f"{errno.errorcode.get(exc.errno, 'EIO')} ({exc.strerror or 'I/O error'})"
        where = f"{what}: {path}" if path else what
        return _failure(FailureClass.STORAGE, rank, f"{where}; {STORAGE_ADVICE[exc.errno]}", exc, path=path)
    if isinstance(exc, _dist_error()):
        return replace(_failure(FailureClass.INFRASTRUCTURE, rank, "peer lost in a collective", exc), secondary=True)
    if isinstance(exc, (*ray_any, ConnectionError, TimeoutError)):
        return _failure(FailureClass.INFRASTRUCTURE, rank, _first_line(exc), exc)
    return _failure(FailureClass.USER, rank, _first_line(exc), exc)


def primary_failure(failures: Sequence[Failure]) -> Failure:
    """The attempt's cause among its ranks' failures: a process ended with its lost owner first
    (what the ranks said of their end is its consequence), then a dead or preempted process (its
    peers fail because of it), then any failure that is not a lost peer, in arrival order."""
    if not failures:
        raise ValueError("primary_failure needs at least one failure")
    return next((f for f in failures if f.owner_lost), None) or \
        next((f for f in failures if is_process_loss(f)), None) or \
        next((f for f in failures if not f.secondary), failures[0])


def is_process_loss(failure: Failure) -> bool:
    """A rank's process is gone (died, killed, preempted): the cause, whatever its peers raised."""
    return failure.failure_class in (FailureClass.INFRASTRUCTURE, FailureClass.PREEMPTION) and not failure.secondary


def on_lost_node(failure: Failure, *, node: str, address: str) -> Failure:
    """A rank's process loss on a node the cluster lists as dead: the whole node was lost
    (its raylet died, the machine went away), infrastructure, with the node named."""
    if not is_process_loss(failure):
        raise ValueError(f"only a lost process is a lost node's failure, got {failure.summary!r}")
    who = f"rank {failure.rank}" if failure.rank >= 0 else "driver"
    return replace(failure, failure_class=FailureClass.INFRASTRUCTURE, node=node,
                   reason=f"{who}: node {node} ({address}) lost")


def on_lost_owner(failure: Failure, *, owner: str) -> Failure:
    """A rank's process loss (or the preemption its SIGTERM looked like) after `owner`, the actor
    that owned the process, died: Ray ends what a dead actor owned, so the cause is the owner's
    loss, infrastructure, found by the driver (`Failure.owner_lost`)."""
    if not is_process_loss(failure):
        raise ValueError(f"only a lost process is a lost owner's failure, got {failure.summary!r}")
    who = f"rank {failure.rank}" if failure.rank >= 0 else "driver"
    return replace(failure, failure_class=FailureClass.INFRASTRUCTURE, owner_lost=True,
                   reason=f"{who}: its process was ended with its owner, {owner}, which was lost")


def _failure(klass: FailureClass, rank: int, what: str, exc: BaseException, *, path: str | None = None) -> Failure:
    who = f"rank {rank}" if rank >= 0 else "driver"
    return Failure(failure_class=klass, rank=rank, reason=f"{who}: {what}", detail=_short(exc), path=path)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}"[:300] if lines else type(exc).__name__


def _short(exc: BaseException) -> str:
    """The exception's last line (Ray puts the cause's message last), for the log."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}"[:1000] if lines else type(exc).__name__


def _ray_types() -> tuple[type | tuple[()], type | tuple[()], tuple[type, ...]]:
    try:
        from ray.exceptions import RayActorError, RayError, RayTaskError
    except ImportError:  # no Ray: nothing is a Ray error
        return (), (), ()
    return RayTaskError, RayActorError, (RayError,)


def _dist_error() -> type | tuple[()]:
    try:
        from torch.distributed import DistError
    except ImportError:
        return ()
    return DistError
