"""Quarantine entries of a broken read: the read error that stopped their file's import, and when
(and by which stored request) a later complete import of the same file superseded them

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('quarantined_requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('file_error', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('superseded_at', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('superseded_by', sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('quarantined_requests', schema=None) as batch_op:
        batch_op.drop_column('superseded_by')
        batch_op.drop_column('superseded_at')
        batch_op.drop_column('file_error')
