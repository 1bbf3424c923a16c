"""held_capacity.rule: why a holding was held (issue 40): the warm pool's hold rule
(just-in-time, keep-alive) or a spare's sizing; '' for lines written before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("held_capacity") as batch:
        batch.add_column(sa.Column("rule", sa.String(32), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("held_capacity") as batch:
        batch.drop_column("rule")
