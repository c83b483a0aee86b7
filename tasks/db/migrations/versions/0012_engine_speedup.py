"""The engine check's measured speedup on the serving engine (decode phase, plain vs the domain's
config on the same requests) beside the one predicted from the engine's own cost profile

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 04:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

COLUMNS = ("plain_decode_tokens_per_s", "spec_decode_tokens_per_s", "measured_speedup",
           "predicted_speedup")


def upgrade() -> None:
    with op.batch_alter_table('engine_checks', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('engine_profile', sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('engine_checks', schema=None) as batch_op:
        batch_op.drop_column('engine_profile')
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
