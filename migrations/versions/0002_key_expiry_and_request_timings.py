"""API key expiry; request records keep the model asked for, time to first token and duration.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Batch mode: SQLite recreates the table, PostgreSQL alters it in place.
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("request_records") as batch:
        batch.add_column(sa.Column("model", sa.String(200), nullable=True))
        batch.add_column(sa.Column("ttft_s", sa.Double(), nullable=True))
        batch.add_column(sa.Column("duration_s", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_records") as batch:
        batch.drop_column("duration_s")
        batch.drop_column("ttft_s")
        batch.drop_column("model")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("expires_at")
