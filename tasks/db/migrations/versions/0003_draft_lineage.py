"""draft lineage

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 08:53:25.186564
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('draft_training_requests',
    sa.Column('draft_name', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('split', sa.String(length=16), nullable=False),
    sa.PrimaryKeyConstraint('draft_name', 'request_id', name=op.f('pk_draft_training_requests'))
    )
    with op.batch_alter_table('draft_models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('status', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('version', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('window_start', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('window_end', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('train_requests', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('heldout_requests', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('params', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('heldout', sa.JSON(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('draft_models', schema=None) as batch_op:
        batch_op.drop_column('heldout')
        batch_op.drop_column('params')
        batch_op.drop_column('heldout_requests')
        batch_op.drop_column('train_requests')
        batch_op.drop_column('window_end')
        batch_op.drop_column('window_start')
        batch_op.drop_column('version')
        batch_op.drop_column('status')

    op.drop_table('draft_training_requests')
