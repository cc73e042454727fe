"""Real backend servers for tests and benchmarks (bench.scale, tests/e2e/test_replicas.py): PostgreSQL 15 and S3.

PostgreSQL: ``initdb`` + ``postgres`` from /usr/lib/postgresql/15/bin (Debian package
``postgresql``) in a temp dir, on a free loopback port, trust auth. ``initdb`` refuses to run as
root, so as root the cluster is made and run as ``nobody`` (its directory handed to that user).
S3: moto's standalone server (``moto_server``, PyPI ``moto[server]``) in its own process, driven
through boto3 like AWS S3 or MinIO. Each returns None with the reason when it cannot start, so a
fixture skips with one clear line.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_BIN = Path(os.environ.get("FEDMOE_PG_BIN", "/usr/lib/postgresql/15/bin"))
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> str | None:
    """None once something listens on ``port``, else why not (the process died or took too long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return None
        except OSError:
            time.sleep(0.05)
    return f"not listening after {timeout:.0f} s"


@dataclass
class Postgres:
    """A running throwaway cluster; ``url`` connects as the superuser to database ``fedmoe``."""

    directory: Path
    port: int
    proc: subprocess.Popen
    user: str | None
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/fedmoe"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres() -> Postgres | str:
    """A fresh cluster on a free port, or the reason it could not start."""
    if not (PG_BIN / "initdb").is_file():
        return f"PostgreSQL server binaries not found in {PG_BIN} (Debian: apt-get install postgresql)"
    user = "nobody" if os.geteuid() == 0 else None
    directory = Path(tempfile.mkdtemp(prefix="fedmoe-pg-"))
    data = directory / "data"
    if user:
        entry = pwd.getpwnam(user)
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    init = subprocess.run([str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                           "--no-sync"], capture_output=True, text=True, cwd=directory, user=user)
    if init.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        return f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1:]}"
    port = free_port()
    proc = subprocess.Popen([str(PG_BIN / "postgres"), "-D", str(data), "-p", str(port), "-k", str(directory),
                             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"],
                            stdout=subprocess.DEVNULL, stderr=open(directory / "log", "w"), cwd=directory,
                            start_new_session=True, user=user)  # user None: as this process
    why = _wait_for_port(port, proc, START_TIMEOUT)
    server = Postgres(directory, port, proc, user)
    if why is None:
        why = _create_database(server)
    if why is not None:
        log = (directory / "log").read_text(errors="replace").strip().splitlines()[-1:] if (directory / "log").exists() else []
        server.stop()
        return f"postgres {why} {log}"
    return server


def _create_database(server: Postgres) -> str | None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT
    while True:  # listening comes a moment before it accepts logins
        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{server.port}/postgres", autocommit=True) as db:
                db.execute("CREATE DATABASE fedmoe")
            return None
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                return f"refused logins: {exc}"
            time.sleep(0.1)


@dataclass
class S3Server:
    """A running moto server: ``endpoint`` for boto3 (any credentials are accepted)."""

    port: int
    proc: subprocess.Popen
    endpoint: str = field(init=False)

    def __post_init__(self) -> None:
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_s3() -> S3Server | str:
    """moto's S3-compatible server on a free port, or the reason it could not start."""
    try:
        import moto.server  # noqa: F401
    except ImportError as exc:
        return f"moto server not installed ({exc}; pip install 'moto[server]')"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    why = _wait_for_port(port, proc, START_TIMEOUT)
    server = S3Server(port, proc)
    if why is not None:
        server.stop()
        return f"moto server {why}"
    return server


def s3_env(server: S3Server) -> dict[str, str]:
    """The usual AWS variables pointing at ``server`` (moto takes any key)."""
    return {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "fedmoe-test",
            "AWS_SECRET_ACCESS_KEY": "fedmoe-test", "AWS_DEFAULT_REGION": "us-east-1"}
