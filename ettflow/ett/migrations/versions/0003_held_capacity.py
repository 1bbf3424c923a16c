"""Capacity held for a run outside its slots: runs.held_s, runs.unused_spare_s, runs.capacity_ett_pct.

Rows archived before this revision keep NULL there (nothing was recorded of what was held).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("held_s", "unused_spare_s", "capacity_ett_pct")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("runs", sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:  # SQLite drops columns by copying the table
        for name in reversed(COLUMNS):
            batch.drop_column(name)
