"""domain_configs: K by batch size

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 19:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('k_schedule', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.drop_column('k_schedule')
