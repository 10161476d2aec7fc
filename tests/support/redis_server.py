"""A real `redis-server` for tests and the bench: started on a free loopback port with its own
temporary directory, stopped by the caller.

API:

- `RedisServer(workdir, *, password=None, appendonly=True, appendfsync="everysec", extra=(), launcher=())`:
  describes a server whose files (AOF, log) live in `workdir` (created if missing); `extra` are
  more `redis-server` arguments, `launcher` a command put in front (the bench pins CPUs with it).
- `server.start(timeout_s=10.0)`: picks a free port on 127.0.0.1, runs
  `redis-server --port N --bind 127.0.0.1 --dir workdir --save '' --appendonly yes|no ...`
  and waits (bounded, `timeout_s` seconds) until it answers PING; raises RuntimeError with the
  server's log tail when it does not. Returns `self`.
- `server.url` → `redis://127.0.0.1:N/0` (with `:password@` when one is set); `server.port`.
- `server.stop(timeout_s=10.0)`: SIGTERM, then SIGKILL after `timeout_s` seconds; idempotent.
- `server.kill()`: SIGKILL at once (a crash); `server.start()` again reuses `workdir` and so its
  AOF file, on a new free port unless `port` is given to `start(port=...)`.
- `with RedisServer(tmp).start() as server:` stops it on exit.
- conftest.py fixtures on top of this: `redis_server` (session-scoped, one server for the run;
  `appendonly yes`, `everysec`) and `redis_prefix` (a fresh key prefix per test, so tests sharing
  the server never see each other's keys: pass it as `store.prefix` / `RedisTaskStore(prefix=)`).
  Tests that need a server of their own (a password, persistence off, a crash) build one here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType


def redis_server_binary() -> str | None:
    """The path of `redis-server`, or None when it is not installed."""
    return (
        shutil.which("redis-server")
        or (os.path.exists("/usr/bin/redis-server") and "/usr/bin/redis-server")
        or None
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process on loopback; see the module docstring."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        password: str | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        extra: tuple[str, ...] = (),
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.password = password
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra = extra
        self.launcher = launcher
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://[:password@]127.0.0.1:<port>/0`."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, *, port: int | None = None) -> RedisServer:
        """Start the server and wait until it answers PING (at most `timeout_s` s). Raises RuntimeError."""
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test.sh installs it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--logfile",
            str(self.workdir / "redis.log"),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            [*self.launcher, *args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within {timeout_s:g} s; "
            f"log:\n{self.log_tail()}"
        )

    def _ping(self) -> bool:
        """True when the server answers PING (or asks for the password: it is up)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                answer = sock.recv(64)
        except OSError:
            return False
        return answer.startswith((b"+PONG", b"-NOAUTH"))

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines of the server's log file."""
        try:
            return "\n".join((self.workdir / "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (SIGKILL after `timeout_s` s) and wait; does nothing when not running."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL now (a crash), and reap the process."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
    ) -> None:
        self.stop()
