"""initial schema: traffic, runs, samples, quality, results, promotions

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-21 05:21:22.060534
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('acceptance_estimates',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('drafter', sa.String(length=200), nullable=False),
    sa.Column('k', sa.Integer(), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.Column('acceptance_rate', sa.Float(), nullable=False),
    sa.Column('mean_accepted_length', sa.Float(), nullable=False),
    sa.Column('conditional_acceptance', sa.JSON(), nullable=True),
    sa.Column('predicted_speedup', sa.Float(), nullable=True),
    sa.Column('predicted_speedup_lo', sa.Float(), nullable=True),
    sa.Column('predicted_speedup_hi', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_acceptance_estimates')),
    sa.UniqueConstraint('run_id', 'domain', 'drafter', 'k', name=op.f('uq_acceptance_estimates_run_id_domain_drafter_k'))
    )
    with op.batch_alter_table('acceptance_estimates', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_acceptance_estimates_run_id'), ['run_id'], unique=False)

    op.create_table('cost_profiles',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('hardware_profile', sa.String(length=200), nullable=False),
    sa.Column('component', sa.String(length=32), nullable=False),
    sa.Column('drafter', sa.String(length=200), nullable=True),
    sa.Column('k', sa.Integer(), nullable=True),
    sa.Column('batch_size', sa.Integer(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_cost_profiles'))
    )
    with op.batch_alter_table('cost_profiles', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cost_profiles_run_id'), ['run_id'], unique=False)

    op.create_table('domain_configs',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('drafter', sa.String(length=200), nullable=True),
    sa.Column('k', sa.Integer(), nullable=True),
    sa.Column('max_batch_size', sa.Integer(), nullable=True),
    sa.Column('predicted_speedup', sa.Float(), nullable=True),
    sa.Column('measured_speedup', sa.Float(), nullable=True),
    sa.Column('samples', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'domain', name=op.f('pk_domain_configs'))
    )
    op.create_table('draft_models',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=True),
    sa.Column('base_model', sa.String(length=200), nullable=True),
    sa.Column('model_uri', sa.String(length=500), nullable=True),
    sa.Column('target_id', sa.String(length=200), nullable=False),
    sa.Column('target_fingerprint', sa.String(length=200), nullable=True),
    sa.Column('domains', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_draft_models')),
    sa.UniqueConstraint('name', name=op.f('uq_draft_models_name'))
    )
    with op.batch_alter_table('draft_models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_draft_models_run_id'), ['run_id'], unique=False)

    op.create_table('eval_runs',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('target_id', sa.String(length=200), nullable=True),
    sa.Column('target_fingerprint', sa.String(length=200), nullable=True),
    sa.Column('hardware_profile', sa.String(length=200), nullable=True),
    sa.Column('window_start', sa.DateTime(), nullable=True),
    sa.Column('window_end', sa.DateTime(), nullable=True),
    sa.Column('params', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_eval_runs'))
    )
    op.create_table('live_measurements',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('drafter', sa.String(length=200), nullable=False),
    sa.Column('k', sa.Integer(), nullable=False),
    sa.Column('batch_size', sa.Integer(), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.Column('acceptance_rate', sa.Float(), nullable=True),
    sa.Column('mean_accepted_length', sa.Float(), nullable=True),
    sa.Column('plain_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('spec_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('predicted_speedup', sa.Float(), nullable=True),
    sa.Column('measured_speedup', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_live_measurements'))
    )
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_live_measurements_run_id'), ['run_id'], unique=False)

    op.create_table('promotions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('target_id', sa.String(length=200), nullable=False),
    sa.Column('config_name', sa.String(length=200), nullable=True),
    sa.Column('config_version', sa.String(length=32), nullable=True),
    sa.Column('alias', sa.String(length=32), nullable=False),
    sa.Column('action', sa.String(length=32), nullable=False),
    sa.Column('forced', sa.Boolean(), nullable=False),
    sa.Column('actor', sa.String(length=200), nullable=True),
    sa.Column('gates', sa.JSON(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_promotions'))
    )
    with op.batch_alter_table('promotions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_promotions_run_id'), ['run_id'], unique=False)

    op.create_table('quality_results',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('suite', sa.String(length=100), nullable=False),
    sa.Column('scope', sa.String(length=64), nullable=False),
    sa.Column('expectation', sa.String(length=100), nullable=False),
    sa.Column('column_name', sa.String(length=100), nullable=True),
    sa.Column('success', sa.Boolean(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('observed', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_quality_results'))
    )
    with op.batch_alter_table('quality_results', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quality_results_run_id'), ['run_id'], unique=False)

    op.create_table('quarantined_requests',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('source_file', sa.String(length=500), nullable=False),
    sa.Column('line_number', sa.Integer(), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=True),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('raw', sa.Text(), nullable=True),
    sa.Column('imported_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_quarantined_requests')),
    sa.UniqueConstraint('source_file', 'line_number', name=op.f('uq_quarantined_requests_source_file_line_number'))
    )
    with op.batch_alter_table('quarantined_requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quarantined_requests_imported_at'), ['imported_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_quarantined_requests_reason'), ['reason'], unique=False)

    op.create_table('traffic_requests',
    sa.Column('id', sa.String(length=200), nullable=False),
    sa.Column('requested_at', sa.DateTime(), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('domain_source', sa.String(length=100), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('messages', sa.JSON(), nullable=True),
    sa.Column('response', sa.Text(), nullable=False),
    sa.Column('temperature', sa.Float(), nullable=False),
    sa.Column('top_k', sa.Integer(), nullable=False),
    sa.Column('top_p', sa.Float(), nullable=False),
    sa.Column('max_tokens', sa.Integer(), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('target_fingerprint', sa.String(length=200), nullable=True),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=True),
    sa.Column('response_token_ids', sa.JSON(), nullable=True),
    sa.Column('prompt_chars', sa.Integer(), nullable=False),
    sa.Column('response_chars', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('response_tokens', sa.Integer(), nullable=True),
    sa.Column('redactions', sa.Integer(), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('source_file', sa.String(length=500), nullable=False),
    sa.Column('source_line', sa.Integer(), nullable=False),
    sa.Column('imported_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_traffic_requests'))
    )
    with op.batch_alter_table('traffic_requests', schema=None) as batch_op:
        batch_op.create_index('ix_traffic_requests_domain_requested_at', ['domain', 'requested_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_traffic_requests_requested_at'), ['requested_at'], unique=False)

    op.create_table('validations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=True),
    sa.Column('check_name', sa.String(length=64), nullable=False),
    sa.Column('drafter', sa.String(length=200), nullable=True),
    sa.Column('k', sa.Integer(), nullable=True),
    sa.Column('request_id', sa.String(length=200), nullable=True),
    sa.Column('passed', sa.Boolean(), nullable=False),
    sa.Column('statistic', sa.Float(), nullable=True),
    sa.Column('p_value', sa.Float(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_validations'))
    )
    with op.batch_alter_table('validations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_validations_run_id'), ['run_id'], unique=False)

    op.create_table('eval_samples',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('domain', sa.String(length=64), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['eval_runs.run_id'], name=op.f('fk_eval_samples_run_id_eval_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'request_id', name=op.f('pk_eval_samples'))
    )


def downgrade() -> None:
    op.drop_table('eval_samples')
    with op.batch_alter_table('validations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_validations_run_id'))

    op.drop_table('validations')
    with op.batch_alter_table('traffic_requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_traffic_requests_requested_at'))
        batch_op.drop_index('ix_traffic_requests_domain_requested_at')

    op.drop_table('traffic_requests')
    with op.batch_alter_table('quarantined_requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_quarantined_requests_reason'))
        batch_op.drop_index(batch_op.f('ix_quarantined_requests_imported_at'))

    op.drop_table('quarantined_requests')
    with op.batch_alter_table('quality_results', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_quality_results_run_id'))

    op.drop_table('quality_results')
    with op.batch_alter_table('promotions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_promotions_run_id'))

    op.drop_table('promotions')
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_live_measurements_run_id'))

    op.drop_table('live_measurements')
    op.drop_table('eval_runs')
    with op.batch_alter_table('draft_models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_draft_models_run_id'))

    op.drop_table('draft_models')
    op.drop_table('domain_configs')
    with op.batch_alter_table('cost_profiles', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cost_profiles_run_id'))

    op.drop_table('cost_profiles')
    with op.batch_alter_table('acceptance_estimates', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_acceptance_estimates_run_id'))

    op.drop_table('acceptance_estimates')
