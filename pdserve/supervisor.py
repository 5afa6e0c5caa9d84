"""Supervision for `pdserve up`: restart what died, give up on what keeps dying.

A component (node or router) that exits while the cluster is up is started
again with the same flags, ports and node id, after a delay that doubles with
each crash in the window (1 s, 2 s, 4 s ... 30 s). One that crashed more than
``max_crashes`` times within ``window_s`` is given up on, with one line naming
it and its log; the rest keep serving. The embedded Redis is restarted on its
port the same way: nodes and routers reconnect and re-register by themselves.

``poll`` does one round without blocking (never waits for a restarted process
to load its model), so one thread can watch every component and still react
to a stop signal at once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from common.grpc_server import health_check
from pdserve.launcher import Component, LocalCluster

REDIS = "redis"


class Health(Enum):
    UP = "up"  # running (serving, or loading after a restart)
    WAITING = "waiting"  # exited; restarts at restart_at
    GIVEN_UP = "given up"  # crashed too often; left down


@dataclass(slots=True)
class Watch:
    """What the supervisor knows of one component."""

    name: str
    state: Health = Health.UP
    crashes: deque = field(default_factory=deque)  # monotonic times of recent exits
    restart_at: float = 0.0
    restarts: int = 0
    # A restarted process is announced once its health check answers.
    announce_serving: bool = False


@dataclass(slots=True)
class SupervisorConfig:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_crashes: int = 5  # more crashes than this within window_s: give up
    window_s: float = 120.0


class Supervisor:
    def __init__(
        self, cluster: LocalCluster, config: SupervisorConfig | None = None, say=print
    ) -> None:
        self.cluster = cluster
        self.config = config or SupervisorConfig()
        self.say = say
        self.watches: dict[str, Watch] = {c.name: Watch(c.name) for c in cluster.components}
        if cluster.redis is not None:
            self.watches[REDIS] = Watch(REDIS)

    def restarts(self) -> dict[str, int]:
        """Restarts so far, per component (for metrics and tests)."""
        return {name: w.restarts for name, w in self.watches.items()}

    @property
    def given_up(self) -> list[str]:
        return [w.name for w in self.watches.values() if w.state is Health.GIVEN_UP]

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for watch in self.watches.values():
            if watch.state is Health.UP:
                code = self._exit_code(watch.name)
                if code is not None:
                    self._crashed(watch, code, now)
                elif watch.announce_serving and self._serving(watch.name):
                    watch.announce_serving = False
                    self.say(f"pdserve: {watch.name} serving again")
            elif watch.state is Health.WAITING and now >= watch.restart_at:
                self._restart(watch)

    # ------------------------------------------------------------- internals
    def _component(self, name: str) -> Component:
        return next(c for c in self.cluster.components if c.name == name)

    def _exit_code(self, name: str) -> int | None:
        if name == REDIS:
            process = self.cluster.redis.process
            return None if process is None else process.poll()
        return self._component(name).process.poll()

    def _serving(self, name: str) -> bool:
        if name == REDIS:
            return True
        c = self._component(name)
        return health_check(c.address, timeout=0.2, tls=self.cluster.spec.tls)

    def _log(self, name: str) -> str:
        log_dir = self.cluster.spec.log_dir
        if name == REDIS or not log_dir:
            return "its output above"
        return f"{log_dir}/{name}.log"

    def _crashed(self, watch: Watch, code: int, now: float) -> None:
        cfg = self.config
        watch.crashes.append(now)
        while watch.crashes and now - watch.crashes[0] > cfg.window_s:
            watch.crashes.popleft()
        n = len(watch.crashes)
        if n > cfg.max_crashes:
            watch.state = Health.GIVEN_UP
            self.say(
                f"pdserve: giving up on {watch.name}: it exited {n} times within "
                f"{cfg.window_s:g} s (last code {code}); see {self._log(watch.name)}. "
                "The rest keep serving."
            )
            return
        delay = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (n - 1))
        watch.state = Health.WAITING
        watch.restart_at = now + delay
        self.say(
            f"pdserve: {watch.name} exited with code {code}; restarting in {delay:g} s "
            f"(crash {n} of at most {cfg.max_crashes} within {cfg.window_s:g} s)"
        )

    def _restart(self, watch: Watch) -> None:
        if watch.name == REDIS:
            try:
                self.cluster.redis.start()  # same port, same config
            except RuntimeError as e:  # counts as another crash
                self.say(f"pdserve: redis-server failed to restart: {e}")
                self._crashed(watch, -1, time.monotonic())
                return
        else:
            self.cluster.respawn(self._component(watch.name))
        watch.state = Health.UP
        watch.restarts += 1
        watch.announce_serving = True
