"""Cost profiles kept between runs: each profile's key (hardware, engine and its version, dtype,
target fingerprint), the hardware it was measured on, when it was measured, and the run it was
reused from

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('cost_profile_checks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('device', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('processor', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('engine', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('engine_version', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('dtype', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('target_fingerprint', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('hardware', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('measured_at', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('reused_from', sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f('ix_cost_profile_checks_target_fingerprint'),
                              ['target_fingerprint'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('cost_profile_checks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cost_profile_checks_target_fingerprint'))
        for name in ('reused_from', 'measured_at', 'hardware', 'target_fingerprint', 'dtype',
                     'engine_version', 'engine', 'processor', 'device'):
            batch_op.drop_column(name)
