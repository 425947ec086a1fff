"""What a rollback does to the gateway's database (docs/operators.md, "Upgrade and rollback").

The gateway migrates its database to its newest Alembic revision when it starts; there is no
downgrade at start. An older gateway (a `helm rollback`) whose migrations stop short of the
database's revision refuses to start, naming the revision, and changes nothing: the data and the
newer schema stay, so rolling forward again, or restoring a backup, is always possible.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from alembic.util.exc import CommandError
from sqlalchemy import create_engine, inspect, text

from crescent.services.tenancy import database


def _revision(url: str) -> str:
    engine = create_engine(database.database_url(url))
    with engine.connect() as connection:
        return connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one()


def test_an_older_gateway_refuses_a_newer_schema_and_leaves_it_alone(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path}/gateway.sqlite3"
    current = database.MIGRATIONS
    engine = database.connect_database(url)  # this release: the newest revision
    secret = database.server_secret(engine, "cache_salt")
    newest = _revision(url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()

    # The release before: the same migrations but the newest.
    older = tmp_path / "older-migrations"
    shutil.copytree(database.MIGRATIONS, older, ignore=shutil.ignore_patterns("__pycache__"))
    (newest_file,) = [p for p in (older / "versions").glob("*.py") if p.name.startswith(f"{newest}_")]
    newest_file.unlink()
    monkeypatch.setattr(database, "MIGRATIONS", older)
    with pytest.raises(CommandError, match=f"Can't locate revision identified by '{newest}'"):
        database.connect_database(url)

    # Nothing was downgraded or dropped: the current release opens it as it left it.
    monkeypatch.setattr(database, "MIGRATIONS", current)
    again = database.connect_database(url)
    assert _revision(url) == newest
    assert set(inspect(again).get_table_names()) == tables
    assert database.server_secret(again, "cache_salt") == secret
