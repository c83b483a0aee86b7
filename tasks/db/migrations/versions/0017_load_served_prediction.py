"""The load check's prediction along what vLLM served: per level, the predicted speedup priced on
the tokens the config's server generated, beside the one on the logged responses

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 14:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('load_check_levels') as batch:
        batch.add_column(sa.Column('predicted_served_speedup', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('load_check_levels') as batch:
        batch.drop_column('predicted_served_speedup')
