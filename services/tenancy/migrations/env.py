"""Alembic environment: runs on the connection ``database.migrate`` hands over (no alembic.ini)."""

from alembic import context
from sqlalchemy import text

connection = context.config.attributes["connection"]
if connection.dialect.name == "postgresql":
    # Gateways starting together migrate one at a time; released when the transaction ends.
    connection.execute(text("SELECT pg_advisory_xact_lock(7264015)"))
context.configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
