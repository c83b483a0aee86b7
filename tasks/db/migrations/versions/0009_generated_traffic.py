"""Generated traffic: rows the target answered for draft training, marked by their generation run
and the logged request they came from (NULL on production traffic)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('traffic_requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('generated_by', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('generated_from', sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f('ix_traffic_requests_generated_by'), ['generated_by'],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table('traffic_requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_traffic_requests_generated_by'))
        batch_op.drop_column('generated_from')
        batch_op.drop_column('generated_by')
