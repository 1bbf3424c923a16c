"""Initial warehouse schema: runs, attempts, run_components, events, failures, checkpoints.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _run_fk() -> sa.Column:
    return sa.Column(
        "run_id",
        sa.String(255),
        sa.ForeignKey("runs.run_id", ondelete="CASCADE"),
        primary_key=True,
        nullable=False,
    )


def _col(name: str, type_: sa.types.TypeEngine, *, null: bool = False, pk: bool = False):
    return sa.Column(name, type_, nullable=null, primary_key=pk)


def upgrade() -> None:
    op.create_table(
        "runs",
        _col("run_id", sa.String(255), pk=True),
        _col("model", sa.String(255)),
        _col("flow_run_id", sa.String(255), null=True),
        _col("mode", sa.String(64)),
        _col("status", sa.String(32)),
        _col("tags", sa.JSON()),
        *(_col(n, sa.Double()) for n in ("wall_start", "wall_end", "wall_s", "tts_s")),
        _col("started_training", sa.Boolean()),
        _col("nof", sa.Integer()),
        *(_col(n, sa.Double()) for n in ("ttr_total_s", "ttr_mean_s", "ett_pct", "ett_l1_pct")),
        *(_col(n, sa.Integer()) for n in ("effective_steps", "replayed_steps", "checkpoint_saves")),
        _col("checkpoint_blocking_s", sa.Double()),
        _col("archived_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_runs_model", "runs", ["model"])
    op.create_index("ix_runs_wall_start", "runs", ["wall_start"])
    op.create_table(
        "attempts",
        _run_fk(),
        _col("attempt", sa.Integer(), pk=True),
        _col("start", sa.Double()),
        _col("end", sa.Double()),
        _col("failed", sa.Boolean()),
        _col("phase_raw_s", sa.JSON()),
    )
    op.create_table(
        "run_components",
        _run_fk(),
        _col("kind", sa.String(16), pk=True),
        _col("name", sa.String(128), pk=True),
        _col("exposed_s", sa.Double()),
        _col("raw_s", sa.Double(), null=True),
        _col("owner", sa.String(32), null=True),
    )
    op.create_table(
        "events",
        _run_fk(),
        *(_col(n, sa.Integer(), pk=True) for n in ("attempt", "rank", "seq")),
        _col("phase", sa.String(64)),
        _col("start", sa.Double()),
        _col("end", sa.Double()),
        _col("attrs", sa.JSON()),
    )
    op.create_table(
        "failures",
        _run_fk(),
        _col("attempt", sa.Integer(), pk=True),
        _col("rank", sa.Integer()),
        _col("failure_class", sa.String(32)),
        _col("reason", sa.Text()),
        *(_col(n, sa.Double()) for n in ("failed_at", "detected_at", "ttr_s")),
        _col("recovered", sa.Boolean()),
        _col("cascaded", sa.Boolean()),
    )
    op.create_table(
        "checkpoints",
        _run_fk(),
        *(_col(n, sa.Integer(), pk=True) for n in ("attempt", "rank", "seq")),
        _col("kind", sa.String(16)),
        *(_col(n, sa.Double()) for n in ("start", "end", "duration_s")),
        _col("step", sa.BigInteger(), null=True),
        _col("path", sa.Text(), null=True),
        _col("bytes", sa.BigInteger(), null=True),
    )


def downgrade() -> None:
    for table in ("checkpoints", "failures", "events", "run_components", "attempts"):
        op.drop_table(table)
    op.drop_index("ix_runs_wall_start", table_name="runs")
    op.drop_index("ix_runs_model", table_name="runs")
    op.drop_table("runs")
