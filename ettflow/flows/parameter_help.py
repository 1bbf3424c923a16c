"""The help of every `refresh_model` parameter, as the deployment's run form shows it.

Prefect 3.9.1 builds a deployment's parameter schema (`prefect.utilities.callables.
parameter_schema`) from the flow function's signature and the ``Args:`` section of its
docstring (Google style): each parameter's text becomes its ``description`` in the schema,
which the UI's run form shows under the field. (A `pydantic.Field` in `Annotated` is
overridden there by the docstring's, and a `Field` as the default value reaches a deployment
run as the default itself when the run does not set it.) `with_parameter_help` writes that
section from `REFRESH_HELP` before the flow is made, and refuses a parameter without help, so
a new parameter cannot reach the run form undocumented.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TypeVar

from ettflow.trainer.config import Switches, fail_at_grammar

F = TypeVar("F", bound=Callable)

# every trainer switch (`trainer.config.Switches`) and the flow's own, as the run form lists them
SWITCH_HELP: dict[str, str] = {
    "parallel_init": "independent init stages run concurrently",
    "fast_batch": "compile on a synthetic batch while the data pipeline warms up",
    "compile": "torch.compile the dense step (false: eager)",
    "compile_cache": "restore and save the compile-cache archive",
    "async_checkpoint": "asynchronous checkpoints with staging (false: synchronous)",
    "memory_checkpoint": "the in-memory checkpoint tier (a copy of each save in host memory that outlives the ranks)",
    "live_recovery": "survivors keep running and a warm spare takes a failed rank",
    "warm_pool": "ranks and spares from trainer processes prewarmed before the run",
    "local_inductor_cache": "without the compile cache, keep PyTorch's own inductor cache across processes",
    "delta_checkpoint": "periodic checkpoints (and in-memory copies) hold only the embedding rows touched since the "
                        "one before, on full bases (anchors are always full)",
    "publish_in_trainer": "publish while the trainer holds its devices (the baseline's way)",
    "delta_snapshot": "store the snapshot as the rows that changed since the current one (checked to predict as the "
                      "full one; `ettflow publish --materialize` writes it whole)",
}
missing = {f.name for f in fields(Switches)} - set(SWITCH_HELP)
if missing:  # a new switch cannot reach the run form undocumented
    raise TypeError(f"switches without help in SWITCH_HELP: {sorted(missing)}")

REFRESH_HELP: dict[str, str] = {
    "model": "The model's name (lowercase letters, digits, - and _): its lineage, checkpoints and snapshots.",
    "mode": "baseline or optimized: the preset of the trainer's switches (baseline: sequential init, compile "
            "on the first real batch, synchronous checkpoints, no compile cache, no in-memory checkpoints, every rank "
            "restarted after a failure, publishing in the trainer).",
    "switches": "Single switches on top of the mode, e.g. {\"compile_cache\": false}:\n\n"
                + "\n".join(f"- `{name}`: {text}" for name, text in SWITCH_HELP.items()),
    "architecture": "ModelConfig fields: embedding_dim, dense_arch, over_arch, learning rates (null: the defaults).",
    "data_root": "The folder of hourly data windows (window=YYYYMMDDHH/*.parquet); null: tiny synthetic data, "
                 "made on first use.",
    "windows": "The windows to train, explicitly (null: the ones past the model's watermark, see max_windows).",
    "eval_windows": "The held-out windows for evaluation and the snapshot's validation (null: the newest window).",
    "max_embeddings": "A cap on the rows of every embedding table (null: the data schema's sizes).",
    "world_size": "The number of trainer ranks (one Ray actor each).",
    "batch_size": "Examples per rank per step.",
    "max_steps": "Stop training after this many steps (null: one pass over the windows).",
    "checkpoint_every_steps": "Checkpoint interval in steps (null: computed from the measured save time and "
                              "failure rate, Young/Daly).",
    "eval_batches": "Held-out batches evaluated after training.",
    "device": "auto, cpu or cuda (auto: cuda when the worker has GPUs).",
    "fail_at": "Injected failures, to see and measure a recovery, e.g. [\"kill:rank=1:step=16\"].\n\n"
               + fail_at_grammar(markdown=True),
    "work_root": "Where checkpoints and the compile cache live (null: the per-user ettflow folder).",
    "snapshot_root": "Where inference snapshots are published (null: the per-user ettflow folder).",
    "spool_root": "Where the run's phase events are spooled (null: the per-user ettflow folder).",
    "warehouse_url": "The warehouse's SQLAlchemy URL, without a password (parameters are stored in clear); null: "
                     "warehouse_secret, else the worker's ETTFLOW_WAREHOUSE_URL, else the per-user SQLite file.",
    "warehouse_secret": "The name of a Prefect Secret block that holds the warehouse URL (with its password).",
    "tags": "Free labels stored with the run's ETT row, e.g. {\"team\": \"ads\"}.",
    "max_windows": "At most this many windows past the watermark per refresh (the newest is held out).",
    "bootstrap_windows": "Windows the first refresh of a model trains (null: max_windows).",
    "warm_start": "Start from the parent refresh's anchor checkpoint (false: from scratch).",
    "claim_wait_s": "Seconds to wait while another refresh of the model holds its windows; then this one ends "
                    "Completed, skipped.",
    "keep_refreshes": "Run checkpoint folders kept, besides the current and the parent anchors.",
    "gate_max_auc_drop": "The most the held-out AUC may drop against the current snapshot before the new one "
                         "is gated (null: no AUC gate).",
    "gate_max_logloss_increase": "The most the held-out log loss may rise against the current snapshot before "
                                 "the new one is gated (null: no log-loss gate).",
    "placement_strategy": "How the ranks spread over the Ray nodes: PACK (as few nodes as possible), SPREAD "
                          "(over nodes where possible) or STRICT_SPREAD (one rank per node).",
    "min_world_size": "A restart after lost capacity may run with as few as this many ranks, its checkpoint "
                      "resharded (null: it waits for world_size ranks).",
    "capacity_wait_s": "The longest an attempt waits for its placement (capacity) before the run fails as an "
                       "infrastructure failure; the wait counts as scheduling.",
}


def args_section(help_texts: Mapping[str, str], names: list[str]) -> str:
    """The docstring's ``Args:`` section, one entry per name, continuation lines indented."""
    lines = ["Args:"]
    for name in names:
        first, *rest = help_texts[name].splitlines()
        lines.append(f"    {name}: {first}")
        lines += [textwrap.indent(line, " " * 8) if line.strip() else "" for line in rest]
    return "\n".join(lines)


def with_parameter_help(fn: F, help_texts: Mapping[str, str] = REFRESH_HELP) -> F:
    """Append the ``Args:`` section of `fn`'s parameters to its docstring (before `@flow`)."""
    names = list(inspect.signature(fn).parameters)
    missing = [n for n in names if not help_texts.get(n)]
    if missing:
        raise TypeError(f"{fn.__name__}: parameters without help {missing}: add them to "
                        "ettflow/flows/parameter_help.py (the deployment's run form shows it)")
    fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{args_section(help_texts, names)}\n"
    return fn
