"""The acceptance plot's intervals: per draft position, the 95% interval of the conditional
acceptance (bootstrap over requests), stored beside the rates

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('acceptance_estimates') as batch:
        batch.add_column(sa.Column('conditional_acceptance_ci', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('acceptance_estimates') as batch:
        batch.drop_column('conditional_acceptance_ci')
