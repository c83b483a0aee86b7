"""Production talks back: vLLM's per-request spec-decode metrics kept with the imported traffic,
the scrapes of the serving deployments' counters, and the monitor's alerts and rollbacks

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 08:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'request_spec_metrics',
        sa.Column('request_id', sa.String(length=200), nullable=False),
        sa.Column('config_version', sa.String(length=32), nullable=True),
        sa.Column('spec_steps', sa.Integer(), nullable=False),
        sa.Column('draft_tokens', sa.Integer(), nullable=False),
        sa.Column('accepted_tokens', sa.Integer(), nullable=False),
        sa.Column('num_spec_tokens', sa.Integer(), nullable=True),
        sa.Column('acceptance_histogram', sa.JSON(), nullable=True),
        sa.Column('created_at', sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(['request_id'], ['traffic_requests.id'],
                                name=op.f('fk_request_spec_metrics_request_id_traffic_requests'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('request_id', name=op.f('pk_request_spec_metrics')))
    op.create_index(op.f('ix_request_spec_metrics_config_version'), 'request_spec_metrics',
                    ['config_version'], unique=False)
    op.create_table(
        'monitor_scrapes',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('deployment', sa.String(length=200), nullable=False),
        sa.Column('url', sa.String(length=500), nullable=False),
        sa.Column('scraped_at', sa.DateTime(), nullable=False),
        sa.Column('series', sa.Integer(), nullable=False),
        sa.Column('start', sa.String(length=16), nullable=True),
        sa.Column('config_name', sa.String(length=200), nullable=True),
        sa.Column('config_version', sa.String(length=32), nullable=True),
        sa.Column('run_id', sa.String(length=200), nullable=True),
        sa.Column('domains', sa.JSON(), nullable=True),
        sa.Column('drafts', sa.Integer(), nullable=False),
        sa.Column('draft_tokens', sa.Integer(), nullable=False),
        sa.Column('accepted_tokens', sa.Integer(), nullable=False),
        sa.Column('accepted_per_pos', sa.JSON(), nullable=True),
        sa.Column('delta_drafts', sa.Integer(), nullable=False),
        sa.Column('delta_draft_tokens', sa.Integer(), nullable=False),
        sa.Column('delta_accepted', sa.Integer(), nullable=False),
        sa.Column('delta_per_pos', sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_monitor_scrapes')))
    op.create_index(op.f('ix_monitor_scrapes_deployment'), 'monitor_scrapes', ['deployment'], unique=False)
    op.create_index(op.f('ix_monitor_scrapes_scraped_at'), 'monitor_scrapes', ['scraped_at'], unique=False)
    op.create_table(
        'monitor_promises',
        sa.Column('deployment', sa.String(length=200), nullable=False),
        sa.Column('config_name', sa.String(length=200), nullable=False),
        sa.Column('config_version', sa.String(length=32), nullable=False),
        sa.Column('domain', sa.String(length=64), nullable=False),
        sa.Column('run_id', sa.String(length=200), nullable=True),
        sa.Column('k', sa.Integer(), nullable=True),
        sa.Column('speculative_config', sa.JSON(), nullable=True),
        sa.Column('promise_e', sa.Float(), nullable=True),
        sa.Column('promise_lo', sa.Float(), nullable=True),
        sa.Column('promise_hi', sa.Float(), nullable=True),
        sa.Column('break_even', sa.Float(), nullable=True),
        sa.Column('profile', sa.String(length=200), nullable=True),
        sa.Column('created_at', sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint('deployment', 'config_name', 'config_version', 'domain',
                                name=op.f('pk_monitor_promises')))
    op.create_table(
        'monitor_events',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('deployment', sa.String(length=200), nullable=False),
        sa.Column('config_name', sa.String(length=200), nullable=True),
        sa.Column('config_version', sa.String(length=32), nullable=True),
        sa.Column('series', sa.Integer(), nullable=True),
        sa.Column('domains', sa.JSON(), nullable=True),
        sa.Column('window_start', sa.DateTime(), nullable=True),
        sa.Column('window_end', sa.DateTime(), nullable=True),
        sa.Column('drafts', sa.Integer(), nullable=True),
        sa.Column('production_e', sa.Float(), nullable=True),
        sa.Column('promise_lo', sa.Float(), nullable=True),
        sa.Column('promise_hi', sa.Float(), nullable=True),
        sa.Column('break_even', sa.Float(), nullable=True),
        sa.Column('evidence', sa.JSON(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_monitor_events')))
    op.create_index(op.f('ix_monitor_events_deployment'), 'monitor_events', ['deployment'], unique=False)
    op.create_index(op.f('ix_monitor_events_created_at'), 'monitor_events', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_monitor_events_created_at'), table_name='monitor_events')
    op.drop_index(op.f('ix_monitor_events_deployment'), table_name='monitor_events')
    op.drop_table('monitor_events')
    op.drop_table('monitor_promises')
    op.drop_index(op.f('ix_monitor_scrapes_scraped_at'), table_name='monitor_scrapes')
    op.drop_index(op.f('ix_monitor_scrapes_deployment'), table_name='monitor_scrapes')
    op.drop_table('monitor_scrapes')
    op.drop_index(op.f('ix_request_spec_metrics_config_version'), table_name='request_spec_metrics')
    op.drop_table('request_spec_metrics')
