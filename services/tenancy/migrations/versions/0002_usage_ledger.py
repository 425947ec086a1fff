"""The usage ledger: one row per request, priced with cache-hit, cache-miss and output prices.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("request_id", sa.String(100), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("api_key_id", sa.String(64), sa.ForeignKey("api_keys.id"), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("reasoning_tokens", sa.Integer, nullable=False),
        sa.Column("ttft_s", sa.Float, nullable=True),
        sa.Column("cost_nusd", sa.BigInteger, nullable=False),
        sa.Column("savings_nusd", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_usage_tenant_created", "usage", ["tenant_id", "created_at"])
    op.create_index("ix_usage_created", "usage", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_created", "usage")
    op.drop_index("ix_usage_tenant_created", "usage")
    op.drop_table("usage")
