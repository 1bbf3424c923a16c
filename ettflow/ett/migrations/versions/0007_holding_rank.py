"""held_capacity.for_rank: the rank a pooled worker became (issue 43: the ETT artifact names
the run's pooled ranks); NULL for spares, keepers, flow processes and lines written before.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("held_capacity") as batch:
        batch.add_column(sa.Column("for_rank", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("held_capacity") as batch:
        batch.drop_column("for_rank")
