"""The engine check: each domain's exported config served by vLLM, its acceptance counters beside
the estimate of the same requests, and the gate's verdict

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 18:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('engine_checks',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('engine', sa.String(length=32), nullable=False),
    sa.Column('engine_version', sa.String(length=64), nullable=True),
    sa.Column('speculative_config', sa.JSON(), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('passed', sa.Boolean(), nullable=True),
    sa.Column('reason', sa.String(length=2000), nullable=True),
    sa.Column('requests', sa.Integer(), nullable=True),
    sa.Column('k', sa.Integer(), nullable=True),
    sa.Column('estimate_e', sa.Float(), nullable=True),
    sa.Column('estimate_e_lo', sa.Float(), nullable=True),
    sa.Column('estimate_e_hi', sa.Float(), nullable=True),
    sa.Column('engine_e', sa.Float(), nullable=True),
    sa.Column('estimate_rates', sa.JSON(), nullable=True),
    sa.Column('engine_rates', sa.JSON(), nullable=True),
    sa.Column('greedy_checked', sa.Integer(), nullable=True),
    sa.Column('greedy_equal', sa.Integer(), nullable=True),
    sa.Column('plain_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('spec_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('start_s', sa.Float(), nullable=True),
    sa.Column('counters', sa.JSON(), nullable=True),
    sa.Column('per_request', sa.JSON(), nullable=True),
    sa.Column('log_path', sa.String(length=1000), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'domain', name=op.f('pk_engine_checks'))
    )


def downgrade() -> None:
    op.drop_table('engine_checks')
