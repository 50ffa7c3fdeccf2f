"""``tessera db`` (migrate the schema) and what every database command shares: the ``--database-url`` /
``--data-dir`` options, the settings they give, a session on a migrated database (else an error that says what
to run), the key-version counter that tells the API processes a key changed, and the local actor.

User errors raise ValueError, which ``tessera.cli.main`` prints without a traceback. SQLAlchemy and alembic are
imported inside the commands, so that every ``tessera`` command starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from tessera.auth import KeyVersion
    from tessera.settings import Settings


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common = database_options()
    database = subparsers.add_parser("db", help="create or migrate the database schema")
    db_commands = database.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    up = db_commands.add_parser("upgrade", parents=[common], help="migrate the schema up (to the newest)")
    up.add_argument("--revision", default="head", metavar="REV", help="target revision (default head)")
    up.set_defaults(func=cmd_db_upgrade)
    down = db_commands.add_parser("downgrade", parents=[common], help="migrate the schema down")
    down.add_argument("revision", metavar="REV", help="target revision; 'base' drops every table")
    down.set_defaults(func=cmd_db_downgrade)


def database_options() -> argparse.ArgumentParser:
    """The parent parser of every command that opens the database: ``--database-url`` and ``--data-dir``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        metavar="URL",
        help="sqlite:///PATH or postgresql://USER@HOST/DB (default: TESSERA_DATABASE_URL, else SQLite "
        "under the data dir)",
    )
    common.add_argument(
        "--data-dir", type=Path, metavar="DIR", help="data folder (default: TESSERA_DATA_DIR, else .tessera)"
    )
    return common


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    from tessera import db

    url = settings_from(args).database_url
    before = migration_step(db.current_revision, url)
    after = migration_step(db.upgrade, url, args.revision)
    if before == after:
        print(f"{db.redact(url)}: already at revision {after}")
    else:
        print(f"{db.redact(url)}: upgraded from {before or 'an empty database'} to revision {after}")


def cmd_db_downgrade(args: argparse.Namespace) -> None:
    from tessera import db

    url = settings_from(args).database_url
    before = migration_step(db.current_revision, url)
    after = migration_step(db.downgrade, url, args.revision)
    print(f"{db.redact(url)}: downgraded from revision {before} to {after or 'base (no tables)'}")


def settings_from(args: argparse.Namespace) -> Settings:
    from tessera.settings import Settings

    given = {"database_url": args.database_url, "data_dir": args.data_dir}
    return Settings(**{k: v for k, v in given.items() if v is not None})


@contextlib.contextmanager
def key_version(args: argparse.Namespace) -> Iterator[KeyVersion | None]:
    """The API processes' key-version counter, to tell them a key changed: in TESSERA_REDIS_URL's Redis, or
    in the embedded one a `tessera up` on the data dir runs. None when there is neither."""
    from tessera.auth import KeyVersion

    version = KeyVersion.from_settings(settings_from(args))
    try:
        yield version
    finally:
        if version is not None:
            version.redis.close()


@contextlib.contextmanager
def open_session(args: argparse.Namespace) -> Iterator[Session]:
    """A session on a database that is reachable and at the newest migration, else a clear error."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from tessera import db

    url = settings_from(args).database_url
    current, head = migration_step(db.current_revision, url), db.head_revision()
    if current != head:
        state = "has no Tessera tables" if current is None else f"is at revision {current}, not {head}"
        raise ValueError(f"the database {db.redact(url)} {state}: run `tessera db upgrade` first")
    engine = db.make_engine(url)
    try:
        with db.session_factory(engine)() as session:
            yield session
    except (OperationalError, ProgrammingError) as exc:
        raise ValueError(database_error(url, exc)) from None
    finally:
        engine.dispose()


def migration_step(step, url: str, *args: Any) -> Any:
    """Run a ``tessera.db`` migration function; unreachable databases and unknown revisions become
    ValueErrors that say what to do."""
    from alembic.util import CommandError
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from tessera import db

    try:
        return step(url, *args)
    except (OperationalError, ProgrammingError) as exc:
        raise ValueError(database_error(url, exc)) from None
    except CommandError as exc:
        raise ValueError(f"{db.redact(url)}: {exc}") from None


def database_error(url: str, exc: Exception) -> str:
    from tessera import db

    detail = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    return (
        f"database {db.redact(url)}: {detail}. Check that it is running and reachable "
        "(--database-url or TESSERA_DATABASE_URL), and that `tessera db upgrade` has run."
    )


def cli_actor() -> str:
    from tessera.audit import local_actor

    return local_actor()
