"""Real servers the tests start: child processes that print `listening on URL`, Node and Python
tools installed on first use (once per machine, linked from ignored folders of the checkout), small
aiohttp apps on loopback."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A child process that prints `listening on URL` on stdout once ready."""

    def __init__(
        self, argv: list[str], *, env: dict[str, str] | None = None, ready_prefix: str = "listening on "
    ) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for _ in range(50):
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith(ready_prefix):
                self.url = line.strip().removeprefix(ready_prefix)
                return
        self.stop()
        raise RuntimeError(f"{argv} did not start: {self.lines!r}")

    def kill(self) -> None:
        """SIGKILL the child (no cleanup runs) and reap it."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def stop(self) -> None:
        """SIGTERM (then, after 5 s, SIGKILL) the child and reap it. Not SIGINT: a run started from
        a background shell job (as CI runners start it) hands its children SIGINT ignored, which the
        SDK's servers keep, so each stop would wait out the 5 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server whose URL must be known before it starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Where the Node packages and the other SDKs' virtual environments are installed once per machine,
# not once per checkout (a CI run starts from a clean clone each time): MCP_TASKS_PROXY_TEST_CACHE,
# else $XDG_CACHE_HOME/mcp-tasks-proxy-tests (an absolute XDG_CACHE_HOME only, as the XDG spec
# says), else ~/.cache/mcp-tasks-proxy-tests. Always an absolute path: the checkout links to it.
_XDG_CACHE = os.environ.get("XDG_CACHE_HOME", "")
CACHE = (
    Path(
        os.environ.get("MCP_TASKS_PROXY_TEST_CACHE")
        or (Path(_XDG_CACHE) if os.path.isabs(_XDG_CACHE) else Path.home() / ".cache")
        / "mcp-tasks-proxy-tests"
    )
    .expanduser()
    .absolute()
)


def _cached(folder: Path, what: str, build: Callable[[Path], None]) -> None:
    """Make `folder` (an ignored folder of the checkout) a link to the machine-wide install of
    `what` under CACHE, built there first by `build(target)` unless a finished one is there (a
    finished one is used without the lock, so a read-only cache serves too). Builds are
    serialised by a lock file, and one left unfinished (a run killed midway) is built again.
    Where CACHE cannot be written, the install is built in `folder` itself."""
    target = CACHE / f"{hashlib.sha256(what.encode()).hexdigest()[:16]}"
    if not _finished(target, what):
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
            lock = open(CACHE / f"{target.name}.lock", "w")  # (held for the build below)
        except OSError:
            if folder.is_symlink():
                folder.unlink()
            _build_once(folder, what, build)
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _build_once(target, what, build)
    if folder.is_symlink() and folder.resolve() == target.resolve():
        return
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    link = folder.with_name(f".{folder.name}.{os.getpid()}.link")
    link.unlink(missing_ok=True)
    link.symlink_to(target, target_is_directory=True)
    os.replace(link, folder)  # (whole: a file or an old link there is replaced at once)


def _finished(target: Path, what: str) -> bool:
    """Whether `target` holds a finished build of `what`."""
    finished = target / ".finished"
    return finished.exists() and finished.read_text() == what


def _build_once(target: Path, what: str, build: Callable[[Path], None]) -> None:
    """`build(target)` into an emptied `target`, unless a finished build of `what` is there."""
    if _finished(target, what):
        return
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    build(target)
    (target / ".finished").write_text(what)


def npm_install(folder: Path, *packages: str, timeout_s: float = 300) -> None:
    """`npm install packages` for the tests that need Node packages: into the machine-wide CACHE on
    first use, which `folder` (an ignored folder of the checkout, with its own package.json) then
    links to. Fails when npm is missing."""
    npm = shutil.which("npm")
    assert npm, f"npm must be on the PATH to install {', '.join(packages)} (README: Run all tests)"

    def build(target: Path) -> None:
        (target / "package.json").write_text('{"private": true}\n')
        subprocess.run(
            [npm, "install", "--silent", "--no-audit", "--no-fund", *packages],
            cwd=target,
            check=True,
            timeout=timeout_s,
        )

    _cached(folder, "npm " + " ".join(sorted(packages)), build)


def python_venv(folder: Path, requirement: str, *, timeout_s: float = 600) -> Path:
    """A virtual environment with `requirement` pip-installed, for tests that run an SDK other than
    the project's own (e.g. `mcp==1.26.0`): built in the machine-wide CACHE on first use (for this
    Python), which `folder` (an ignored folder of the checkout) then links to; returns its `python`.
    Fails when the venv cannot be created or pip cannot install (network, index)."""

    def build(target: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True, timeout=120)
        subprocess.run(
            [
                str(target / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                requirement,
            ],
            check=True,
            timeout=timeout_s,
        )

    _cached(folder, f"venv {requirement} python {sys.version.split()[0]} {sys.base_prefix}", build)
    return folder / "bin" / "python"


@asynccontextmanager
async def served_app(app: web.Application) -> AsyncIterator[int]:
    """Serve a small aiohttp `app` on a free loopback port for the block; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextmanager
def black_hole() -> Iterator[int]:
    """A loopback port whose listener never accepts and whose backlog is already full, for the
    block: a connection to it is neither accepted nor refused, so its connect times out (the
    kernel drops the SYN). Yields the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers: list[socket.socket] = []
    try:
        for _ in range(3):  # the first fills the accept queue; the others wait in SYN retries
            filler = socket.socket()
            filler.setblocking(False)
            with suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


FIXTURE_STDIO = {
    "command": sys.executable,
    "args": [str(ROOT / "tests" / "fixtures" / "legacy_server.py"), "--stdio"],
}


def run_cli(
    *args: str, timeout: float = 30, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """`mcp-tasks-proxy ARGS` from the checkout (`timeout` in s; `env` added to this environment;
    `input` on stdin), its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        input=input,
    )


def serve_on_store(store: Path, config_dir: Path) -> subprocess.CompletedProcess:
    """Start the proxy from the command line on a minimal config (written to `config_dir`) whose
    store is the directory `store`, as an operator would: for tests of what a start refuses (a
    start that is not refused would serve: bounded by 30 s)."""
    config = config_dir / "proxy.yaml"
    config.write_text(
        f"mcpServers:\n  demo:\n    command: 'true'\nstore:\n  path: {store}\nlisten:\n  port: 0\n"
    )
    return run_cli("--config", str(config))
