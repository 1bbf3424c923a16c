"""Refresh lineage and window claims: refresh_lineage, window_claims.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _col(name: str, type_: sa.types.TypeEngine, *, null: bool = False, pk: bool = False):
    return sa.Column(name, type_, nullable=null, primary_key=pk)


def upgrade() -> None:
    op.create_table(
        "refresh_lineage",
        _col("run_id", sa.String(255), pk=True),
        _col("model", sa.String(255)),
        _col("windows", sa.JSON()),
        _col("first_window", sa.String(255), null=True),
        _col("last_window", sa.String(255), null=True),
        _col("parent_run_id", sa.String(255), null=True),
        *(_col(n, sa.Text(), null=True) for n in ("parent_anchor", "parent_snapshot", "anchor", "snapshot")),
        _col("outcome", sa.String(16)),
        _col("reason", sa.Text(), null=True),
        _col("created_at", sa.Double()),
        _col("finished_at", sa.Double(), null=True),
    )
    op.create_index("ix_refresh_lineage_model", "refresh_lineage", ["model"])
    op.create_table(
        "window_claims",
        _col("model", sa.String(255), pk=True),
        _col("window", sa.String(255), pk=True),
        _col("run_id", sa.String(255)),
        _col("state", sa.String(16)),
        _col("claimed_at", sa.Double()),
    )
    op.create_index("ix_window_claims_run_id", "window_claims", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_window_claims_run_id", table_name="window_claims")
    op.drop_table("window_claims")
    op.drop_index("ix_refresh_lineage_model", table_name="refresh_lineage")
    op.drop_table("refresh_lineage")
