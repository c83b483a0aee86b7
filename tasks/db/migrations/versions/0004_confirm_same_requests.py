"""confirm: prediction on the same requests, cost-model and sampling errors, greedy consistency

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 18:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

COLUMNS = [
    ('predicted_same_requests', sa.Float()),
    ('cost_model_error', sa.Float()),
    ('subset_expected_tokens', sa.Float()),
    ('domain_expected_tokens', sa.Float()),
    ('sampling_error', sa.Float()),
    ('greedy_checked', sa.Integer()),
    ('greedy_consistent', sa.Integer()),
    ('per_request', sa.JSON()),
]


def upgrade() -> None:
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        for name, kind in COLUMNS:
            batch_op.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('live_measurements', schema=None) as batch_op:
        for name, _ in reversed(COLUMNS):
            batch_op.drop_column(name)
