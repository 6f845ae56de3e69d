"""A throwaway PostgreSQL server on a free loopback port, for tests and benchmarks.

``initdb`` makes a fresh cluster in a private temporary folder and ``pg_ctl`` runs it,
listening on 127.0.0.1 only, with ``trust`` authentication for the ``postgres`` superuser
(nothing outside this machine can reach it, and it is deleted on :meth:`LocalPostgres.stop`).
The binaries are looked up on ``PATH`` and then in Debian's ``/usr/lib/postgresql/<v>/bin``,
where ``apt-get install postgresql`` puts them without linking them onto ``PATH``.

PostgreSQL refuses to run as root, so as root both commands run as the ``postgres`` system
user (``runuser``), in a temporary folder that user owns.

The cluster collates text with ICU's ``en-US``, like a typical production database, so tests
notice any ordering that silently relies on byte order.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from agentmem.errors import StoreUnavailable
from servers.local_redis import free_port, start_moving_port

SYSTEM_USER = "postgres"


def find_binary(name: str) -> str:
    """``name`` from ``PATH``, else from the newest ``/usr/lib/postgresql/<version>/bin``."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    if not versions:
        raise StoreUnavailable(f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")
    return versions[-1]


class LocalPostgres:
    """``start()``/``stop()`` a private PostgreSQL server; usable as a context manager."""

    def __init__(self, *, port: int | None = None) -> None:
        self.initdb, self.pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        self.port = port or free_port()
        self._may_move = port is None  # a port chosen here may be taken before the server binds it
        self.directory: Path | None = None

    @property
    def url(self) -> str:
        """The server's default database."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def create_database(self, name: str) -> str:
        """Create an empty database ``name`` and return its URL (a fresh schema per test, say)."""
        import psycopg  # the `postgres` extra; only this helper and the SQL store need it
        from psycopg import sql

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def start(self, timeout: float = 60.0) -> LocalPostgres:
        """initdb and start a server; a port chosen here that is lost meanwhile is replaced."""
        return start_moving_port(lambda: self._start_once(timeout), self._new_port, attempts=3 if self._may_move else 1)

    def _new_port(self) -> None:
        self.port = free_port()

    def _start_once(self, timeout: float) -> LocalPostgres:
        self.directory = Path(tempfile.mkdtemp(prefix="agentmem-postgres-"))
        if os.geteuid() == 0:
            shutil.chown(self.directory, SYSTEM_USER, SYSTEM_USER)
        data = self.directory / "data"
        try:
            self._run([self.initdb, "-D", str(data), "--username=postgres", "--auth=trust", "--encoding=UTF8",
                       "--locale=C.UTF-8", "--locale-provider=icu", "--icu-locale=en-US"], timeout)
            options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory}"
            self._run([self.pg_ctl, "-D", str(data), "-l", str(self.directory / "server.log"), "-o", options,
                       "-w", "-t", str(int(timeout)), "start"], timeout + 5)
        except StoreUnavailable:
            self.stop()
            raise
        self._may_move = False  # clients hold its URL now: a restart keeps the port
        return self

    def stop(self) -> None:
        if self.directory is None:
            return
        data = self.directory / "data"
        try:
            if (data / "postmaster.pid").exists():
                self._run([self.pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], 60)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _run(self, command: list[str], timeout: float) -> None:
        """Run a server command (as ``postgres`` when we are root); failures carry the server log's tail."""
        as_user = ["runuser", "-u", SYSTEM_USER, "--"] if os.geteuid() == 0 else []
        try:
            done = subprocess.run([*as_user, *command], capture_output=True, text=True, timeout=timeout, check=False,
                                  cwd=self.directory)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StoreUnavailable(f"{Path(command[0]).name} failed: {exc}") from exc
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()
            log = self.directory / "server.log"
            if log.exists():
                detail += "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            raise StoreUnavailable(f"{Path(command[0]).name} failed (exit {done.returncode}): {detail}")

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
