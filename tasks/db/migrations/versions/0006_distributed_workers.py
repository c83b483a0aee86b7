"""Distributed workers: Data Docs pages in the database, the hardware of the profile and confirm
workers

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 01:05:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('data_docs_pages',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('page', sa.String(length=200), nullable=False),
    sa.Column('html', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'page', name=op.f('pk_data_docs_pages'))
    )
    with op.batch_alter_table('eval_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('worker_hardware', sa.JSON(), nullable=True))
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hardware', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.drop_column('hardware')
    with op.batch_alter_table('eval_runs', schema=None) as batch_op:
        batch_op.drop_column('worker_hardware')
    op.drop_table('data_docs_pages')
