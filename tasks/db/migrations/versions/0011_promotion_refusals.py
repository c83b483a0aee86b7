"""Refused rollbacks are audit rows too: a refusal with no champion has no run or target, so
promotions.run_id and promotions.target_id may be NULL

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 12:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('promotions', schema=None) as batch_op:
        batch_op.alter_column('run_id', existing_type=sa.String(length=200), nullable=True)
        batch_op.alter_column('target_id', existing_type=sa.String(length=200), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM promotions WHERE run_id IS NULL OR target_id IS NULL")
    with op.batch_alter_table('promotions', schema=None) as batch_op:
        batch_op.alter_column('target_id', existing_type=sa.String(length=200), nullable=False)
        batch_op.alter_column('run_id', existing_type=sa.String(length=200), nullable=False)
