"""The held-capacity ledger: table held_capacity (`ett.capacity.Holding`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "held_capacity",
        sa.Column("holding_id", sa.String(255), primary_key=True),
        sa.Column("run_id", sa.String(255), nullable=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("used", sa.Boolean(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("released_at", sa.Double(), nullable=False),
        sa.Column("held_s", sa.Double(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("slots", sa.Double(), nullable=False),
        sa.Column("gpus", sa.Double(), nullable=False),
        sa.Column("cpus", sa.Double(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_held_capacity_run_id", "held_capacity", ["run_id"])
    op.create_index("ix_held_capacity_model", "held_capacity", ["model"])


def downgrade() -> None:
    op.drop_index("ix_held_capacity_model", table_name="held_capacity")
    op.drop_index("ix_held_capacity_run_id", table_name="held_capacity")
    op.drop_table("held_capacity")
