"""The load check: each domain's requests streamed through vLLM's OpenAI server at concurrency
levels, plain and with the domain's config; per level the measured speedup with its interval,
the predicted one, latencies and vLLM's /metrics counters; per domain the schedule before and
after the cut

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 08:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

LEVEL_FLOATS = ("plain_tokens_per_s", "spec_tokens_per_s", "measured_speedup", "measured_speedup_lo",
                "measured_speedup_hi", "predicted_speedup")
LATENCIES = ("plain_ttft_p50_s", "plain_ttft_p95_s", "spec_ttft_p50_s", "spec_ttft_p95_s",
             "plain_itl_p50_s", "plain_itl_p95_s", "spec_itl_p50_s", "spec_itl_p95_s")


def upgrade() -> None:
    op.create_table('load_check_domains',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('passed', sa.Boolean(), nullable=True),
    sa.Column('reason', sa.String(length=2000), nullable=True),
    sa.Column('speculative_config', sa.JSON(), nullable=True),
    sa.Column('schedule_before', sa.JSON(), nullable=True),
    sa.Column('schedule_after', sa.JSON(), nullable=True),
    sa.Column('max_level_paying', sa.Integer(), nullable=True),
    sa.Column('plain_log', sa.String(length=1000), nullable=True),
    sa.Column('spec_log', sa.String(length=1000), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'domain', name=op.f('pk_load_check_domains'))
    )
    op.create_table('load_check_levels',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('concurrency', sa.Integer(), nullable=False),
    sa.Column('k', sa.Integer(), nullable=True),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    *[sa.Column(name, sa.Float(), nullable=True) for name in LEVEL_FLOATS],
    sa.Column('pays', sa.Boolean(), nullable=True),
    *[sa.Column(name, sa.Float(), nullable=True) for name in LATENCIES],
    sa.Column('engine_e', sa.Float(), nullable=True),
    sa.Column('engine_rates', sa.JSON(), nullable=True),
    sa.Column('counters', sa.JSON(), nullable=True),
    sa.Column('request_sums', sa.JSON(), nullable=True),
    sa.Column('counters_equal', sa.Boolean(), nullable=True),
    sa.Column('per_request', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'domain', 'concurrency', name=op.f('pk_load_check_levels'))
    )


def downgrade() -> None:
    op.drop_table('load_check_levels')
    op.drop_table('load_check_domains')
