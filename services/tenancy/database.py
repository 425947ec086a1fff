"""Opening the gateway database: SQLite by default, PostgreSQL by URL, schema by Alembic.

``connect_database(url)`` brings the schema to the newest migration (several gateways may start
at once: PostgreSQL serialises them with an advisory lock, SQLite with its file lock and a retry)
and returns a SQLAlchemy engine. Calls block: the gateway makes them from a worker thread.
"""

from __future__ import annotations

import logging
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError

from crescent.services.common.private_files import create_private_file
from crescent.services.tenancy.schema import server_secrets

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_MIGRATE_TRIES = 5


def database_url(url: str) -> str:
    """``url`` with ``~`` expanded in a SQLite path and the psycopg (v3) driver for plain PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = create_private_file(Path(parsed.database).expanduser())  # the salt secret, keys, the ledger
        parsed = parsed.set(database=str(path))
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001 - a DBAPI connection
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")  # another gateway writing: wait, do not fail
    # Readers (usage queries, key checks) never wait for the ledger's writer. In WAL mode a commit
    # with synchronous=NORMAL is written to the log without an fsync: it survives the process
    # being killed (the ledger's promise), not the machine losing power (PostgreSQL's job).
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def connect_database(url: str) -> Engine:
    """An engine for ``url`` whose schema is at the newest migration."""
    engine = create_engine(database_url(url), pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    for attempt in range(1, _MIGRATE_TRIES + 1):
        try:
            migrate(engine)
            break
        except (OperationalError, IntegrityError) as exc:  # another process migrated at the same moment
            if attempt == _MIGRATE_TRIES:
                raise
            log.warning("database migration raced another process (%s); trying again", exc.__class__.__name__)
            time.sleep(0.2 * attempt)
    return engine


def migrate(engine: Engine) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def server_secret(engine: Engine, name: str, nbytes: int = 32) -> bytes:
    """The secret called ``name``, created at random the first time any gateway asks for it."""
    with engine.begin() as connection:
        value = connection.execute(select(server_secrets.c.value).where(server_secrets.c.name == name)).scalar()
        if value is not None:
            return bytes(value)
    try:
        with engine.begin() as connection:
            connection.execute(insert(server_secrets).values(
                name=name, value=secrets.token_bytes(nbytes), created_at=datetime.now(UTC)))
    except IntegrityError:
        pass  # another gateway created it first: use theirs
    with engine.begin() as connection:
        return bytes(connection.execute(select(server_secrets.c.value).where(server_secrets.c.name == name)).scalar_one())
