"""Supervision for `pdserve up`: restart what died, give up on what keeps dying.

A component (node or router) that exits -- while the cluster is up or while it
is still starting -- is started again with the same flags, ports and node id,
after a delay that doubles with each crash in the window (1 s, 2 s, 4 s ...
30 s). One that crashed more than ``max_crashes`` times within ``window_s`` is
given up on, with one line naming it and its log; the rest keep serving. A
restart that serves says so in one line with its new pid. The embedded Redis
is restarted on its port the same way: nodes and routers reconnect and
re-register by themselves.

Some exits are not worth retrying, and ``poll`` then returns a ``Stop`` for
`pdserve up` to act on: a configuration error (exit code 2: a bad flag, a port
in use) from a component that never served, the loss of the last router or the
last decode node (nothing can serve any more), and with ``restart=False``
(`--no-restart`) any exit at all.

``poll`` does one round without blocking (it never waits for a process to
load its model), so one thread can watch every component, start-up included,
and still react to a stop signal at once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from common.grpc_server import health_check
from pdserve.launcher import Component, LocalCluster

REDIS = "redis"
# What every pdserve command exits with on bad configuration (pdserve.cli.main).
CONFIG_ERROR = 2


class Health(Enum):
    STARTING = "starting"  # running, not SERVING yet (first start or a restart)
    SERVING = "serving"  # its health check said SERVING since it last started
    WAITING = "waiting"  # exited; restarts at restart_at
    GIVEN_UP = "given up"  # crashed too often; left down


class Role(Enum):
    ROUTER = "router"
    DECODE = "decode"
    PREFILL = "prefill"
    REDIS = "redis"


@dataclass(slots=True)
class Watch:
    """What the supervisor knows of one component."""

    name: str
    role: Role
    state: Health = Health.STARTING
    crashes: deque = field(default_factory=deque)  # monotonic times of recent exits
    restart_at: float = 0.0
    restarts: int = 0
    served: bool = False  # SERVING at least once since `pdserve up` began


@dataclass(slots=True, frozen=True)
class Stop:
    """Why `pdserve up` must stop, and its exit code."""

    code: int
    message: str


@dataclass(slots=True)
class SupervisorConfig:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_crashes: int = 5  # more crashes than this within window_s: give up
    window_s: float = 120.0
    restart: bool = True  # False (--no-restart): the first exit stops everything


class Supervisor:
    def __init__(
        self, cluster: LocalCluster, config: SupervisorConfig | None = None, say=print
    ) -> None:
        self.cluster = cluster
        self.config = config or SupervisorConfig()
        self.say = say
        self.watches: dict[str, Watch] = {
            c.name: Watch(c.name, Role(c.argv[0])) for c in cluster.components
        }
        if cluster.redis is not None:  # started (and so serving) before anything else
            self.watches[REDIS] = Watch(REDIS, Role.REDIS, Health.SERVING, served=True)
        self.stop: Stop | None = None

    def restarts(self) -> dict[str, int]:
        """Restarts so far, per component (metrics and tests)."""
        return {name: w.restarts for name, w in self.watches.items()}

    @property
    def given_up(self) -> list[str]:
        return [w.name for w in self.watches.values() if w.state is Health.GIVEN_UP]

    def serving(self, role: Role) -> list[str]:
        return [
            w.name for w in self.watches.values() if w.role is role and w.state is Health.SERVING
        ]

    @property
    def loading(self) -> list[str]:
        """Components on their first start: never served, never exited."""
        return [
            w.name
            for w in self.watches.values()
            if w.state is Health.STARTING and not w.served and not w.crashes
        ]

    def can_serve(self) -> bool:
        """A router and a decode node serve (a decode node prefills by itself
        when no prefill node is left)."""
        return bool(self.serving(Role.ROUTER) and self.serving(Role.DECODE))

    def poll(self, now: float | None = None) -> Stop | None:
        """One round: notice exits, schedule and start restarts, notice
        components that came up. Returns why `pdserve up` must stop, if it must."""
        now = time.monotonic() if now is None else now
        for watch in self.watches.values():
            if self.stop is not None:
                break
            if watch.state in (Health.STARTING, Health.SERVING):
                code = self._exit_code(watch.name)
                if code is not None:
                    self._exited(watch, code, now)
                elif watch.state is Health.STARTING and self._serving(watch.name):
                    watch.state = Health.SERVING
                    # A restart's line names its new pid: the one to signal now.
                    self.say(self._component(watch.name).serving_line(again=watch.served))
                    watch.served = True
            elif watch.state is Health.WAITING and now >= watch.restart_at:
                self._restart(watch, now)
        return self.stop

    def log_of(self, name: str) -> str:
        log_dir = self.cluster.spec.log_dir
        if name == REDIS or not log_dir:
            return "its output above"
        return f"{log_dir}/{name}.log"

    # ------------------------------------------------------------- internals
    def _component(self, name: str) -> Component:
        return next(c for c in self.cluster.components if c.name == name)

    def _process(self, name: str):
        return self.cluster.redis.process if name == REDIS else self._component(name).process

    def _exit_code(self, name: str) -> int | None:
        process = self._process(name)
        return None if process is None else process.poll()

    def _serving(self, name: str) -> bool:
        c = self._component(name)
        return health_check(c.address, timeout=0.2, tls=self.cluster.spec.tls)

    def _exited(self, watch: Watch, code: int, now: float) -> None:
        cfg = self.config
        pid = self._process(watch.name).pid
        if not cfg.restart:
            self.stop = Stop(
                1, f"{watch.name} exited with code {code}; see {self.log_of(watch.name)}"
            )
            return
        if code == CONFIG_ERROR and not watch.served:
            # Bad flags or a taken port: the same again K times would not help.
            self.stop = Stop(
                CONFIG_ERROR,
                f"{watch.name} exited with code {code} (a configuration error: a bad flag or "
                f"a port in use) before it served; see {self.log_of(watch.name)}",
            )
            return
        watch.crashes.append(now)
        while watch.crashes and now - watch.crashes[0] > cfg.window_s:
            watch.crashes.popleft()
        n = len(watch.crashes)
        if n > cfg.max_crashes:
            watch.state = Health.GIVEN_UP
            self._check_someone_left(watch.role)
            self.say(
                f"pdserve: giving up on {watch.name}: it exited {n} times within "
                f"{cfg.window_s:g} s (last code {code}); see {self.log_of(watch.name)}."
                + ("" if self.stop else " The rest keep serving.")
            )
            return
        delay = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (n - 1))
        watch.state = Health.WAITING
        watch.restart_at = now + delay
        self.say(
            f"pdserve: {watch.name} (pid {pid}) exited with code {code}; restarting in "
            f"{delay:g} s (restart {n} of {cfg.max_crashes} in {cfg.window_s:g} s)"
        )

    def _check_someone_left(self, role: Role) -> None:
        """Without a router or a decode node nothing is served: stop, rather
        than run a cluster that can only fail."""
        if role not in (Role.ROUTER, Role.DECODE):  # routers route without Redis for a while
            return
        mine = [w for w in self.watches.values() if w.role is role]
        if all(w.state is Health.GIVEN_UP for w in mine):
            logs = ", ".join(self.log_of(w.name) for w in mine)
            what = "router" if role is Role.ROUTER else "decode node"
            self.stop = Stop(1, f"no {what} left to serve (see {logs}); stopping")

    def _restart(self, watch: Watch, now: float) -> None:
        if watch.name == REDIS:
            try:
                self.cluster.redis.start()  # same port, same config
            except RuntimeError as e:  # counts as another crash
                self.say(f"pdserve: redis-server failed to restart: {e}")
                watch.restarts += 1
                self._exited(watch, -1, now)
                return
            watch.state = Health.SERVING
            self.say(
                f"redis-server serving again on {self.cluster.redis_url} "
                f"(pid {self.cluster.redis.process.pid})"
            )
        else:
            self.cluster.respawn(self._component(watch.name))
            watch.state = Health.STARTING
        watch.restarts += 1
