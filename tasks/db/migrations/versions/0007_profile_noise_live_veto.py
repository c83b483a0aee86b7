"""Cost profiles that know their noise (a spread per figure, a check per profile) and live evidence
that can veto (the champion's on/off beside the plan, the live check's verdict, the measured
speedup's interval)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('cost_profile_checks',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('hardware_profile', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('reasons', sa.JSON(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('max_spread', sa.Float(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'hardware_profile', name=op.f('pk_cost_profile_checks'))
    )
    with op.batch_alter_table('cost_profiles', schema=None) as batch_op:
        batch_op.add_column(sa.Column('spread', sa.Float(), nullable=True))
    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('champion_on', sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column('live_check', sa.JSON(), nullable=True))
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('measured_speedup_lo', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('measured_speedup_hi', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        batch_op.drop_column('measured_speedup_hi')
        batch_op.drop_column('measured_speedup_lo')
    with op.batch_alter_table('domain_configs', schema=None) as batch_op:
        batch_op.drop_column('live_check')
        batch_op.drop_column('champion_on')
    with op.batch_alter_table('cost_profiles', schema=None) as batch_op:
        batch_op.drop_column('spread')
    op.drop_table('cost_profile_checks')
