"""failures.seq: a run's failed publish tries are failures too (issue 26), several in one
attempt, so a failure's key is (run_id, attempt, seq): 0 for the attempt's own failure, 1..n
for the publish tries that failed after it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # recreated by copy on every database: the primary key changes (rows keep seq 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*as primary_key=True, not matching locally specified")
        with op.batch_alter_table("failures", recreate="always") as batch:
            batch.add_column(sa.Column("seq", sa.Integer(), nullable=False, server_default="0"))
            batch.create_primary_key("pk_failures", ["run_id", "attempt", "seq"])


def downgrade() -> None:
    op.execute("DELETE FROM failures WHERE seq > 0")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*as primary_key=True, not matching locally specified")
        with op.batch_alter_table("failures", recreate="always") as batch:
            batch.drop_column("seq")
            batch.create_primary_key("pk_failures", ["run_id", "attempt"])
