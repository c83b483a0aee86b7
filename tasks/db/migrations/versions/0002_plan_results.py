"""plan, confirm and validate results: intervals, latencies, hardware profiles

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 07:36:12.571118
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('hardware_profiles',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('device', sa.String(length=200), nullable=False),
    sa.Column('dtype', sa.String(length=32), nullable=False),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_hardware_profiles'))
    )
    with op.batch_alter_table('acceptance_estimates', schema=None) as batch_op:
        batch_op.add_column(sa.Column('mean_accepted_length_lo', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('mean_accepted_length_hi', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('rounds', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('draft_width_share', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('drafter_spec', sa.JSON(), nullable=True))

    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('drafter_spec', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('mean_accepted_length', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('conditional_acceptance', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('predicted_speedup_lo', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('predicted_speedup_hi', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('validation', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('promotable', sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column('reason', sa.Text(), nullable=True))

    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('plain_latency_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('spec_latency_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('gap', sa.Boolean(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.drop_column('gap')
        batch_op.drop_column('spec_latency_s')
        batch_op.drop_column('plain_latency_s')

    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.drop_column('reason')
        batch_op.drop_column('promotable')
        batch_op.drop_column('validation')
        batch_op.drop_column('predicted_speedup_hi')
        batch_op.drop_column('predicted_speedup_lo')
        batch_op.drop_column('conditional_acceptance')
        batch_op.drop_column('mean_accepted_length')
        batch_op.drop_column('drafter_spec')

    with op.batch_alter_table('acceptance_estimates', schema=None) as batch_op:
        batch_op.drop_column('drafter_spec')
        batch_op.drop_column('draft_width_share')
        batch_op.drop_column('rounds')
        batch_op.drop_column('mean_accepted_length_hi')
        batch_op.drop_column('mean_accepted_length_lo')

    op.drop_table('hardware_profiles')
