"""Clean console output: ettflow's own progress and results stay visible; the known
third-party noise is dropped at its source, by name, from one table (`KNOWN_NOISE`).

`quiet_third_party(verbose)` installs that table in the calling process:

- a Python warning (`category` set) gets a `warnings.filterwarnings("ignore", ...)` entry for
  its category and message;
- a log record (`logger` set) is dropped by a filter on exactly that logger, when its message
  matches; the logger's other records pass;
- a line a Ray worker or the raylet forwards to the driver is dropped by the driver through
  Ray's own `RAY_DEDUP_LOGS_SKIP_REGEX` (every pattern of the table), which Ray reads when it
  is imported: call `quiet_third_party` before anything imports `ray`;
- ettflow's own lines from its rank and spare processes (`RankLineFormatter`: every line of a
  record, its traceback's too, prefixed by who wrote it, as torchrun prefixes a rank's output)
  are never folded by Ray's deduplication (`RAY_DEDUP_LOGS_ALLOW_REGEX`), unless the skip
  expression in force drops them: folded, two ranks' lines that differ only in numbers became
  one line carrying Ray's note on how to turn deduplication off, and two ranks' tracebacks of
  one error lost the second's lines (its header printed above the first's frames).

The CLI calls it first thing; each Ray trainer actor calls it in its constructor, with the
verbosity the CLI left in `ETTFLOW_VERBOSE` (Ray's processes inherit the environment of the
process that starts Ray). `verbose=True` installs nothing, so everything shows (and Ray stops
folding repeated lines: `RAY_DEDUP_LOGS=0`).

An error whose class says `explained = True` (its message names what is wrong and what to do:
a bad parameter, an unreachable warehouse, a bad data file) is logged by Prefect's engine
without its traceback in quiet mode (`ExplainedErrorFilter`), and the CLI prints it as one
line (`ettflow.cli.main`); `--verbose` shows the tracebacks.

Prefect's own state-change lines ("Finished in state Completed()", "Beginning flow run",
hook boilerplate) are dropped at their loggers in quiet mode, so a run started by a quiet CLI
does not send them to the Prefect API either; states themselves are still recorded, and
failed states still log.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

VERBOSE_ENV = "ETTFLOW_VERBOSE"  # "1": show everything (set by the CLI, read by trainer processes)
RAY_SKIP_ENV = "RAY_DEDUP_LOGS_SKIP_REGEX"
RAY_ALLOW_ENV = "RAY_DEDUP_LOGS_ALLOW_REGEX"
# the expression that recognises a rank's or a spare's own lines (`RankLineFormatter`) among
# the lines Ray forwards to the driver
RANK_LINE = r"^\[(?:rank \d+|spare)\] "


class RankLineFormatter(logging.Formatter):
    """How a rank's or a spare's process formats its log records (`trainer/rank/actor.py`):
    `[rank N] ` or `[spare] ` before every line a record prints, its message's and its
    traceback's, so each one is the process's own line to Ray's deduplication (`RANK_LINE`)."""

    def __init__(self, who: str) -> None:
        super().__init__("%(message)s")
        self.prefix = f"[{who}] "

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in super().format(record).split("\n"))


@dataclass(frozen=True, kw_only=True)
class Noise:
    """One known third-party message, and how it is recognised.

    `source`: who emits it, for people reading the table. `message`: a regular expression
    searched in the message text. `category`: it is a Python warning of this class; else
    `logger`: it is a log record of exactly this logger; neither: it is a line Ray forwards
    to the driver (a raylet message)."""

    source: str
    message: str
    category: type[Warning] | None = None
    logger: str | None = None

    def __post_init__(self) -> None:
        if self.category is not None and self.logger is not None:
            raise ValueError(f"Noise({self.source!r}) is a warning or a log record, not both: "
                             "give category or logger")
        try:  # as Ray and the filters use it: inside a group (an inline flag there is an error)
            re.compile(f"(?:{self.message})")
        except re.error as exc:
            raise ValueError(f"Noise({self.source!r}).message is not a regular expression: {exc}") from None


KNOWN_NOISE: tuple[Noise, ...] = (
    # TorchRec's sharding planner, once per rank and attempt
    Noise(source="torchrec planner", logger="torchrec.distributed.planner.types",
          message=r"topology was constructed directly rather than via TopologyFactory"),
    Noise(source="torchrec planner", logger="torchrec.distributed.planner.storage_reservations",
          message=r"known issue with TorchRec's dense tensor size calculation"),
    Noise(source="torchrec planner", category=FutureWarning,
          message=r"HeuristicalStorageReservation is known to cause issues"),
    # torch: DCP on ShardedTensor, fx tracing
    Noise(source="torch distributed checkpoint", category=FutureWarning,
          message=r"Please use DTensor instead and we are deprecating ShardedTensor"),
    Noise(source="torch.fx", logger="torch.fx._symbolic_trace", message=r"is_fx_tracing will return true"),
    # dynamo's caching precompile (compile/cache.py), at each cold compile: the identity guards it
    # drops (torch.cat, F.linear, the activations), which the compile cache's key pins
    Noise(source="torch dynamo precompile", logger="torch._dynamo.guards",
          message=r"guard on .* is dropped with caching_precompile=True"),
    # fbgemm_gpu's import-time deprecation banners
    Noise(source="fbgemm_gpu", category=DeprecationWarning,
          message=r"fbgemm_gpu\S* is now DEPRECATED|Failed to import: fbgemm_gpu"),
    Noise(source="fbgemm_gpu", category=UserWarning, message=r"fbgemm_gpu\S* is now DEPRECATED"),
    # Ray: its token and start messages in the driver; the raylet's note on a killed worker
    Noise(source="ray auth", logger="ray._private.authentication.authentication_token_setup",
          message=r"Token authentication is enabled|Generated new authentication token"),
    Noise(source="ray init", logger="ray._private.worker",
          message=r"Started a local Ray instance|Connect(ed|ing) to (existing )?Ray cluster"),
    Noise(source="raylet", message=r"A worker died or was killed while executing a task"),
    # Prefect: the ephemeral server's banner, and the engine's success boilerplate
    Noise(source="prefect server", logger="prefect", message=r"(Starting|Stopping) temporary server"),
    Noise(source="prefect engine", logger="prefect.flow_runs",
          message=r"^(Beginning flow run|Finished in state Completed\(|Running hook |Hook '.*' finished running "
                  r"successfully)"),
    Noise(source="prefect engine", logger="prefect.task_runs",
          message=r"^(Finished in state Completed\(|Running hook |Hook '.*' finished running successfully)"),
    # a run refused by an explained error (the classes that say `explained = True`): the run's own
    # "Failed: refused: ..." line says it; the engine's final line repeats it (issue 42 #8)
    Noise(source="prefect engine", logger="prefect.flow_runs",
          message=r"^Finished in state Failed\(.*\b(ParameterError|DataError|WarehouseUnavailable|WarehouseError): "),
)


class KnownNoiseFilter(logging.Filter):
    """Drops a logger's records whose message matches one of `patterns`."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: let it through, its handler reports it
            return True
        return not self.pattern.search(text)


def is_explained(exc: BaseException | None) -> bool:
    """An error whose message says everything a user needs (`explained = True` on its class)."""
    return exc is not None and getattr(type(exc), "explained", False) is True


# Prefect's engine lines around any failed run, each with the error's traceback: for an explained
# error they echo what its run's final state line ("Finished in state Failed('...')") says
ENGINE_ECHOES = re.compile(r"Encountered exception during execution|Engine execution exited with unexpected "
                           r"exception|Execution of flow run .* exited with unexpected exception")


class ExplainedErrorFilter(logging.Filter):
    """Keeps a record, less the traceback of an explained error (the message line stays); the
    engine's echoes of one (`ENGINE_ECHOES`) go, so a refused run is one line in its log (issue
    42 #8: it was 5 lines and an ERROR in the worker's log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and is_explained(record.exc_info[1]):
            if ENGINE_ECHOES.match(str(record.msg)):
                return False
            record.exc_info, record.exc_text = None, None
        return True


# the loggers whose records carry a failed flow's or task's exception
EXCEPTION_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def verbose_from_env() -> bool:
    """The verbosity the CLI chose (`ETTFLOW_VERBOSE`), as seen by a trainer process."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


def ray_skip_regex(noise: tuple[Noise, ...] = KNOWN_NOISE) -> str:
    """One regular expression for every entry: what the driver drops from forwarded lines."""
    return "|".join(f"(?:{n.message.lstrip('^')})" for n in noise)


def ray_allow_regex(skip: str) -> str:
    """What Ray never folds: a rank's or a spare's own line (`RANK_LINE`) that `skip` (the skip
    expression in force) does not drop: Ray lets an allowed line through before it looks at
    the skip expression."""
    return f"{RANK_LINE}(?!.*(?:{skip}))" if skip else RANK_LINE


def quiet_third_party(verbose: bool, noise: tuple[Noise, ...] = KNOWN_NOISE) -> None:
    """Install `noise` (default: `KNOWN_NOISE`) in this process, unless `verbose`; record the
    choice in `ETTFLOW_VERBOSE` for the processes this one starts. Safe to call again."""
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    if verbose:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        return
    os.environ.setdefault(RAY_SKIP_ENV, ray_skip_regex(noise))
    os.environ.setdefault(RAY_ALLOW_ENV, ray_allow_regex(os.environ[RAY_SKIP_ENV]))  # a user's own kept
    by_logger: dict[str, list[str]] = {}
    for n in noise:
        if n.category is not None:
            warnings.filterwarnings("ignore", message=f"(?s).*(?:{n.message})", category=n.category)
        elif n.logger is not None:
            by_logger.setdefault(n.logger, []).append(n.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, KnownNoiseFilter)]:
            logger.removeFilter(old)
        logger.addFilter(KnownNoiseFilter(patterns))
    for name in EXCEPTION_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExplainedErrorFilter) for f in logger.filters):
            logger.addFilter(ExplainedErrorFilter())


def user_doc(doc: str | None) -> str:
    """A command module's docstring as its `--help` shows it: without the paragraphs written for
    developers (those naming `register(subparsers)` or `main(argv)`)."""
    paragraphs = (doc or "").strip("\n").split("\n\n")
    return "\n\n".join(p for p in paragraphs if "register(" not in p and "main(argv)" not in p)
