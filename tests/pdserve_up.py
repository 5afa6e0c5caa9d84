"""A `pdserve up` subprocess in tests: started as a user starts it, its output
read line by line, the addresses and pids it prints, its children found in
/proc, and a clean stop (SIGTERM, exit 0, nothing left behind)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

ROUTER_LINE = re.compile(r"router listening on (\S+) \(admin API on (\S+)\)")
SERVING_LINE = re.compile(r"(\S+) serving on (\S+) \(pid (\d+)(?:; metrics on (\S+))?\)")
REDIS_LINE = re.compile(r"redis-server on (\S+) \(pid (\d+)\)")
SUPERVISOR_LINE = re.compile(r"supervisor metrics on (\S+)")


class UpProcess:
    """``pdserve up ARGS`` with stdout and stderr merged into ``lines``."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, unset: Iterable[str] = ()
    ) -> None:
        environ = dict(os.environ, **(env or {}))
        for name in unset:
            environ.pop(name, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
        )
        self.started = time.monotonic()
        self.ready_s = 0.0  # from the launch to the banner, once wait_ready has seen it
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str | re.Pattern, timeout: float, start: int = 0) -> re.Match:
        """The first line from index ``start`` on that ``pattern`` matches
        (re.search); fails with the output when none comes within ``timeout``."""
        pattern = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[start:]:
                    if m := pattern.search(line):
                        return m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and start == len(self.lines)):
                    break
                self._changed.wait(min(left, 0.5))
        raise AssertionError(
            f"pdserve up printed no line matching {pattern.pattern!r} within {timeout:g} s "
            f"(exit code {self.proc.poll()}):\n{self.output()}"
        )

    def matches(self, pattern: str | re.Pattern) -> list[re.Match]:
        pattern = re.compile(pattern)
        with self._changed:
            return [m for line in self.lines if (m := pattern.search(line))]

    def wait_ready(self, routers: int = 1, timeout: float = 400) -> None:
        """Until the addresses are printed (the cluster serves); fails with the
        output (and kills it) when they are not."""
        try:
            self.wait_line(ROUTER_LINE, timeout)
            self.wait_line(r"--address \S+.* nodes$", timeout)  # the banner's last line
        except AssertionError:
            self.kill()
            raise
        self.ready_s = time.monotonic() - self.started
        found = self.matches(ROUTER_LINE)
        if len(found) < routers:
            self.kill()
            pytest.fail(f"{len(found)} router lines, expected {routers}:\n{self.output()}")

    @property
    def routers(self) -> list[str]:
        return [m.group(1) for m in self.matches(ROUTER_LINE)]

    @property
    def admins(self) -> list[str]:
        return [m.group(2) for m in self.matches(ROUTER_LINE)]

    @property
    def router(self) -> str:
        return self.routers[0]

    @property
    def admin(self) -> str:
        return self.admins[0]

    @property
    def redis_url(self) -> str | None:
        found = self.matches(REDIS_LINE)
        return found[0].group(1) if found else None

    @property
    def supervisor_metrics_url(self) -> str | None:
        found = self.matches(SUPERVISOR_LINE)
        return found[0].group(1) if found else None

    def metrics_url(self, name: str) -> str | None:
        """A component's /metrics URL, as its serving line printed it."""
        return next((m.group(4) for m in self.matches(SERVING_LINE) if m.group(1) == name), None)

    def pids(self) -> dict[str, int]:
        """Live children by component name (``redis`` for the Redis started
        here), read from /proc: a restarted component has a new pid."""
        out = {}
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        for pid in map(int, children.read_text().split()):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            names = [e.split(b"=", 1)[1] for e in env if e.startswith(b"PDSERVE_LOG_NAME=")]
            if names:
                out[names[0].decode()] = pid
            elif b"redis-server" in cmdline:
                out["redis"] = pid
        return out

    def signal(self, name: str, sig: signal.Signals) -> int:
        """Send ``sig`` to component ``name``; its pid."""
        pid = self.pids()[name]
        os.kill(pid, sig)
        return pid

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, as Ctrl-C would; its exit code. Killed if it overruns."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL it and every child it started (each in its own session)."""
        if self.proc.poll() is None:
            try:
                children = self.pids().values()
            except OSError:
                children = []
            for pid in children:
                with contextlib.suppress(ProcessLookupError):  # gone already
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
