"""Fixtures for the end-to-end tests: the real `spindle` binary on loopback.

The binary is taken from the environment variable SPINDLE_BIN (required; `scripts/test`
builds it and sets it). Each test module gets its own server on a free loopback port,
with its own data directory; a module may stop and restart it on the same data
directory (`server.restart()`), or kill it hard (`server.kill()`).

When a test fails, the tail of the server's stdout and stderr is attached to the
report.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

READY_TIMEOUT_S = float(os.environ.get("SPINDLE_E2E_READY_TIMEOUT", "20"))
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 60

# Every server started in this pytest session (for failure reports and cleanup).
_SERVERS: list["SpindleServer"] = []

# No proxies for loopback, whatever the environment says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "(no file)"
    text = data.decode("utf-8", "replace").splitlines()
    if not text:
        return "(empty)"
    return "\n".join(text[-lines:])


class SpindleServer:
    """One `spindle --config FILE` process and its files."""

    def __init__(self, binary: str, root: Path, port: int):
        self.binary = binary
        self.root = root
        self.port = port
        self.server_name = f"localhost:{port}"
        self.base_url = f"http://127.0.0.1:{port}"
        self.data_dir = root / "data"
        self.config_path = root / "spindle.toml"
        self.stdout_path = root / "spindle.stdout.log"
        self.stderr_path = root / "spindle.stderr.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.last_exit: int | None = None
        # TOML appended to the generated config (a module's own sections, e.g. [voip]).
        self.extra_config = ""

    # -- files ---------------------------------------------------------------
    def write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            f'server_name = "{self.server_name}"\n'
            f'bind = "127.0.0.1:{self.port}"\n'
            f'data_dir = "{self.data_dir}"\n'
            "\n"
            "[registration]\n"
            "mode = \"open\"\n"
            "\n"
            "# The flows send bursts (logins, messages) that the public defaults refuse.\n"
            "[rate_limits]\n"
            "enabled = false\n"
            + self.extra_config
        )

    def logs(self) -> str:
        return (
            f"--- {self.stderr_path} (last {LOG_TAIL_LINES} lines) ---\n"
            f"{_tail(self.stderr_path)}\n"
            f"--- {self.stdout_path} (last {LOG_TAIL_LINES} lines) ---\n"
            f"{_tail(self.stdout_path)}"
        )

    # -- lifecycle -------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        assert not self.running, "server already running"
        self.starts += 1
        banner = f"\n===== spindle start #{self.starts} at {time.strftime('%H:%M:%S')} =====\n".encode()
        out = open(self.stdout_path, "ab")
        err = open(self.stderr_path, "ab")
        out.write(banner)
        err.write(banner)
        out.flush()
        err.flush()
        env = dict(os.environ)
        env.setdefault("RUST_BACKTRACE", "1")
        try:
            self.proc = subprocess.Popen(
                [self.binary, "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=str(self.root),
                env=env,
                start_new_session=True,
            )
        finally:
            out.close()
            err.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        url = f"{self.base_url}/_matrix/client/versions"
        deadline = time.monotonic() + timeout
        last_error = "no attempt"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self.last_exit = code
                self.proc = None
                pytest.fail(
                    f"spindle exited with code {code} before answering {url}\n{self.logs()}",
                    pytrace=False,
                )
            try:
                with _OPENER.open(url, timeout=1.0) as resp:
                    body = resp.read()
                    if resp.status == 200:
                        versions = json.loads(body).get("versions")
                        if isinstance(versions, list) and versions:
                            return
                        last_error = f"200 but no 'versions' list: {body[:200]!r}"
                    else:
                        last_error = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                last_error = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                last_error = repr(e)
            time.sleep(0.1)
        self.kill()
        pytest.fail(
            f"spindle did not answer 200 on {url} within {timeout:.0f}s "
            f"(last: {last_error})\n{self.logs()}",
            pytrace=False,
        )

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code (negative = signal)."""
        if self.proc is None:
            return self.last_exit
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.last_exit = self.proc.returncode
        self.proc = None
        return self.last_exit

    def kill(self) -> int | None:
        """SIGKILL at once (a crash). Returns the exit code."""
        if self.proc is None:
            return self.last_exit
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.last_exit = self.proc.returncode
        self.proc = None
        return self.last_exit

    def restart(self) -> int | None:
        code = self.stop()
        self.start()
        return code


# -- fixtures ------------------------------------------------------------------


@pytest.fixture(scope="session")
def spindle_bin() -> str:
    path = os.environ.get("SPINDLE_BIN")
    if not path:
        pytest.fail(
            "SPINDLE_BIN is not set: point it at the built `spindle` binary "
            "(scripts/test does this)",
            pytrace=False,
        )
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"SPINDLE_BIN={path!r} is not an executable file", pytrace=False)
    return path


@pytest.fixture(scope="module")
def spindle(spindle_bin, tmp_path_factory) -> SpindleServer:
    """A running server, private to the test module, stopped at the module's end."""
    root = tmp_path_factory.mktemp("spindle")
    server = SpindleServer(spindle_bin, root, free_loopback_port())
    server.write_config()
    _SERVERS.append(server)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _SERVERS.remove(server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    text = str(report.longrepr) if report.failed else ""
    # Not for steps that failed only because an earlier one did, nor when the message
    # already carries the logs (a server that would not start).
    if report.failed and "prerequisite step" not in text and "spindle start #" not in text:
        for server in _SERVERS:
            report.sections.append(
                (f"spindle on port {server.port} (data {server.data_dir})", server.logs())
            )


def pytest_sessionfinish(session, exitstatus):
    for server in list(_SERVERS):
        server.kill()
