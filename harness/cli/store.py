"""What every command that opens the tracking store does first: the store is probed once
(:func:`probe_store`: a server that answers within seconds, a database driver that is
installed, a folder a new database can be written in; a command that only reads never
creates or migrates a store), then runs whose process ended without finishing them
(killed outright, out of memory, power lost) are marked FAILED, so that no table, sweep or
UI shows them RUNNING (:func:`harness.store.dead_runs.fail_dead_runs`)."""

from __future__ import annotations

import contextlib
import importlib.util
import sqlite3
import sys
import urllib.error
import urllib.request
from pathlib import Path

from harness.base.errors import HarnessError
from harness.base.paths import is_sqlite_database, writable_folder
from harness.store.dead_runs import fail_dead_runs
from harness.store.location import reserved_paths, sqlite_database, tracking_uri

__all__ = [
    "open_store",
    "probe_store",
    "check_driver",
    "check_own_database",
    "check_study_storage",
    "sqlite_tables",
    "MLFLOW_TABLES",
    "OPTUNA_TABLES",
    "PROBE_TIMEOUT",
]

#: Seconds a tracking server has to answer the probe.
PROBE_TIMEOUT = 5.0
#: SQLAlchemy driver -> (the module it imports, the package that provides it).
DRIVERS = {
    "psycopg": ("psycopg", "psycopg[binary]"),
    "psycopg2": ("psycopg2", "psycopg2-binary"),
    "pg8000": ("pg8000", "pg8000"),
    "asyncpg": ("asyncpg", "asyncpg"),
    "mysqldb": ("MySQLdb", "mysqlclient"),
    "pymysql": ("pymysql", "PyMySQL"),
    "mysqlconnector": ("mysql.connector", "mysql-connector-python"),
    "pyodbc": ("pyodbc", "pyodbc"),
    "pymssql": ("pymssql", "pymssql"),
    "oracledb": ("oracledb", "oracledb"),
    "cx_oracle": ("cx_Oracle", "cx_Oracle"),
}
SETTING = "MLFLOW_TRACKING_URI"
#: Tables by which a tool's SQLite database is recognised as its own.
MLFLOW_TABLES = frozenset({"experiments", "runs", "alembic_version"})
OPTUNA_TABLES = frozenset({"studies", "trials", "alembic_version"})


def open_store(*, read_only: bool = False) -> None:
    """Probe the store (:func:`probe_store`), then mark FAILED the runs left RUNNING by dead
    processes of this host, one line each. ``read_only``: the command only reads runs."""

    probe_store(read_only=read_only)
    for run_id in fail_dead_runs():
        print(
            f"run {run_id} was left RUNNING by a process that ended without finishing it: marked FAILED "
            f"(run --resume continues it from its last checkpoint)",
            file=sys.stderr,
        )


def _driver(uri: str) -> str | None:
    """The driver SQLAlchemy imports for the database URL ``uri`` (its default for a URL
    that names none, such as ``postgresql://``); None for a URL that is not a database's."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if not scheme or scheme in ("http", "https", "file", "databricks"):
        return None
    if "+" in scheme:
        return scheme.split("+", 1)[1]
    # deferred: SQLAlchemy adds 0.4 s to each command that opens the store; a database
    # URL (postgresql://) is the one that needs it
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        return str(make_url(uri).get_dialect().driver)
    except (ArgumentError, NoSuchModuleError, ValueError):
        return None


def check_driver(uri: str, where: str) -> None:
    """A database URL whose driver is not installed is one line naming the package."""
    module, package = DRIVERS.get(_driver(uri) or "", (None, None))
    if module is None:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package of a dotted module is missing
        found = False
    if not found:
        raise HarnessError(
            f"{where} {uri.split('@')[-1] if '@' in uri else uri} needs the database driver "
            f"'{module}', which is not installed: pip install {package}"
        )


def probe_store(*, read_only: bool = False) -> None:
    """Check the tracking store once, before any work, so that a store that cannot work is
    one line within seconds rather than minutes of retries: a server must answer within
    :data:`PROBE_TIMEOUT`; a database URL needs its driver; a SQLite store must be in a
    folder a database can be written in, or, for a command that only reads
    (``read_only``), must already exist and be an MLflow store (reading never creates or
    migrates one)."""

    uri = tracking_uri()
    check_driver(uri, f"the tracking store ({SETTING})")
    if uri.startswith(("http://", "https://")):
        _probe_server(uri)
        return
    database = sqlite_database(uri)
    if database is None:
        return
    shown = f"the tracking store {uri}"
    if read_only:
        if not database.is_file():
            raise HarnessError(f"{shown} does not exist ({SETTING}); reading creates none")
        if (sqlite_tables(database) or set()) >= MLFLOW_TABLES:
            return
        raise HarnessError(
            f"{shown} is an SQLite database without MLflow's tables ({SETTING}); "
            f"reading leaves it as it is"
            if is_sqlite_database(database)
            else f"{shown} is not an SQLite database ({SETTING}); reading leaves it as it is"
        )
    if database.is_file():
        check_own_database(database, f"{shown} ({SETTING})", "MLflow", MLFLOW_TABLES)
    else:
        writable_folder(database.parent, f"{shown} ({SETTING})")


def sqlite_tables(database: Path) -> set[str] | None:
    """The names of the tables of the SQLite database file ``database`` (read only); None
    when it is not an SQLite database or cannot be read."""
    if not is_sqlite_database(database):
        return None
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=PROBE_TIMEOUT)
        ) as db:
            return {
                row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
    except sqlite3.Error:
        return None


def check_own_database(database: Path, shown: str, tool: str, tables: frozenset[str]) -> None:
    """A store or storage that ``tool`` (MLflow, Optuna) would create its tables in is
    taken only when it is new or already ``tool``'s: no file, an empty file, an SQLite
    database without tables, or one holding ``tables``. Another program's database, or a
    file that is not a database, is refused and left as it is. ``shown``: how the refusal
    names it."""
    if not database.is_file() or database.stat().st_size == 0:
        return
    found = sqlite_tables(database)
    if found is None:
        raise HarnessError(
            f"{shown} is a file that is not an SQLite database; it is left as it is: "
            f"give a new file name for {tool}'s database"
        )
    if found and not tables <= found:
        listed = ", ".join(sorted(found)[:4]) + (", ..." if len(found) > 4 else "")
        raise HarnessError(
            f"{shown} is an SQLite database without {tool}'s tables (it holds {listed}); "
            f"it is left as it is: give a new file name for {tool}'s database"
        )


def _probe_server(uri: str) -> None:

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT):
            pass
    except urllib.error.HTTPError:
        return  # it answers
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise HarnessError(
            f"the tracking server {uri} does not answer within {PROBE_TIMEOUT:g} s ({reason}; "
            f"{SETTING}); start it, or unset {SETTING} for the local store"
        ) from None


def check_study_storage(storage: str | None, flag: str = "--storage") -> None:
    """An Optuna or sweep storage is a new database or one that already holds Optuna's
    tables: the tracking store's database, another program's database and a file that is
    not a database are refused, as are a database URL whose driver is not installed and a
    new SQLite database whose folder cannot be written."""

    if storage:
        check_driver(storage, flag)
    if not storage or not storage.startswith("sqlite:///"):
        return
    database = Path(storage.removeprefix("sqlite:///").split("?", 1)[0]).resolve()
    for place in reserved_paths():
        if not place.folder and place.holds(database):
            raise HarnessError(f"{flag} {storage} is {place.what}; give a database of its own")
    if database.is_dir():
        raise HarnessError(f"{flag} {storage} is a folder; give a database file")
    if database.is_file():
        check_own_database(database, f"{flag} {storage}", "Optuna", OPTUNA_TABLES)
        return
    try:  # created on first use: its folder must take it, checked before the dataset loads
        writable_folder(database.parent, "its folder")
    except HarnessError as err:
        raise HarnessError(f"cannot open the Optuna storage {storage}: {err}") from None
