"""`pdserve up`: Redis, decode nodes, prefill nodes and the router as local processes.

Decode nodes start first (they host the KV rendezvous), then prefill nodes,
then the router. With GPUs, each node gets as many as its tensor-parallel size
(``prefill_tp``, ``decode_tp``), consecutive ones (CUDA_VISIBLE_DEVICES),
going round the host's GPUs; without, every node runs on the CPU (its ranks
as processes there). Start-up waits until every
component's grpc.health.v1 says SERVING, and gives up (stopping everything)
when a process exits or the wait times out. Stopping sends SIGTERM to every
child, then SIGKILL to the ones still alive after the grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.grpc_server import health_check
from common.metrics.server import METRICS_PATH, plan_metrics_ports
from common.runtime.ports import check_free, cluster_plan
from common.tls import NO_TLS, TLSConfig
from pdserve.bench.devices import local_gpus
from pdserve.redis_server import RedisServer, free_port
from pdserve.threads import plan_threads


@dataclass
class Component:
    name: str
    address: str  # host:port of its gRPC server
    process: subprocess.Popen
    argv: list[str] = field(default_factory=list)  # `pdserve` arguments, to restart it
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES (None: no GPU)
    metrics_port: int = 0  # its /metrics port (0: none)

    @property
    def metrics_url(self) -> str | None:
        host = self.address.rsplit(":", 1)[0]
        return f"http://{host}:{self.metrics_port}{METRICS_PATH}" if self.metrics_port else None

    def serving_line(self, again: bool = False) -> str:
        """What `pdserve up` prints once it serves (the pid: to signal it, find
        its log); ``again``: after a restart, with the new process's pid."""
        metrics = f"; metrics on {self.metrics_url}" if self.metrics_port else ""
        serving = "serving again" if again else "serving"
        return f"{self.name} {serving} on {self.address} (pid {self.process.pid}{metrics})"


@dataclass
class ClusterSpec:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1  # tensor-parallel size of each prefill node (GPUs each)
    decode_tp: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    admin_port: int = 50052
    redis_url: str | None = None
    engine_args: list[str] = field(default_factory=list)  # passed to every node
    node_args: list[str] = field(default_factory=list)  # e.g. --verify-kv
    decode_args: list[str] = field(default_factory=list)  # e.g. --speculative-config
    router_args: list[str] = field(default_factory=list)  # e.g. --skip-tokenizer-init
    num_routers: int = 1  # replicas beyond the first take free ports
    http_port: int | None = None  # OpenAI HTTP API of the first router (replicas: free ports)
    start_timeout_s: float = 600.0
    stop_grace_s: float = 15.0
    log_dir: str | None = None  # None: children share our stderr
    # `pdserve up` runs a supervisor: plan a /metrics port for it too (after the others').
    supervised: bool = False
    # Extra environment per component name (e.g. "prefill-0"); tests/faults uses it.
    component_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # /metrics ports: None a free one each, 0 none, N: N for the first router,
    # then N+1, ... for the other routers, the decode nodes, the prefill nodes.
    metrics_port: int | None = None
    # Security (docs/security.md). TLS: the same files for every component (each
    # is a server and a client), and for the start-up health checks.
    tls: TLSConfig = NO_TLS
    # With no redis_url, the Redis started here requires this password (and user).
    redis_password: str | None = None
    redis_username: str | None = None
    redis_tls_ca: str | None = None  # with a rediss:// redis_url
    env: dict[str, str] = field(default_factory=dict)  # for every child: secrets go here
    # CPU threads per engine process (pdserve/threads.py): None shares the
    # cores out on a CPU host, 0 leaves torch's default.
    cpu_threads: int | None = None


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.redis: RedisServer | None = None
        self.components: list[Component] = []
        self.redis_url = spec.redis_url
        # (public port, admin port) of each router replica.
        self.router_ports: list[tuple[int, int]] = [(spec.port, spec.admin_port)]
        self.metrics_ports: dict[str, int] = {}  # by component name
        self.http_ports: list[int] = []  # each router's OpenAI HTTP port, when spec.http_port
        self.thread_env: dict[str, str] = {}  # OMP_NUM_THREADS ... for every child

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.port}"

    @property
    def admin_address(self) -> str:
        return f"{self.spec.host}:{self.spec.admin_port}"

    @property
    def router_addresses(self) -> list[str]:
        return [f"{self.spec.host}:{p}" for p, _ in self.router_ports]

    @property
    def admin_addresses(self) -> list[str]:
        return [f"{self.spec.host}:{a}" for _, a in self.router_ports]

    def _gpu_count(self) -> int:
        # nvidia-smi rather than torch: importing torch would cost the
        # supervisor seconds of CPU that its nodes need at start.
        return len(local_gpus())

    def _spawn(self, name: str, argv: list[str], port: int, gpus: str | None) -> Component:
        process = self._popen(name, argv, gpus)
        metrics_port = self.metrics_ports.get(name, 0)
        component = Component(name, f"{self.spec.host}:{port}", process, argv, gpus, metrics_port)
        self.components.append(component)
        return component

    def restart(self, component: Component, timeout_s: float | None = None) -> None:
        """Start a component that exited (or was killed) again, same flags; wait until SERVING."""
        self.respawn(component)
        deadline = time.monotonic() + (timeout_s or self.spec.start_timeout_s)
        while not health_check(component.address, timeout=0.5):
            code = component.process.poll()
            if code is not None:
                raise RuntimeError(f"{component.name} exited with code {code} while restarting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{component.name} not serving after restart")
            time.sleep(0.25)

    def respawn(self, component: Component) -> None:
        """Start a component that exited again, same flags, ports and node id; no wait."""
        if component.process.poll() is None:
            raise RuntimeError(f"{component.name} is still running")
        component.process = self._popen(component.name, component.argv, component.gpus)

    def kill_all(self) -> None:
        """SIGKILL every child at once (a second Ctrl-C: no more waiting)."""
        for c in self.components:
            if c.process.poll() is None:
                c.process.kill()
        if self.redis is not None and self.redis.process is not None:
            self.redis.process.kill()

    def _popen(self, name: str, argv: list[str], gpus: str | None) -> subprocess.Popen:
        env = dict(os.environ, **self._secret_env(), PDSERVE_LOG_NAME=name, PYTHONUNBUFFERED="1")
        env.update(self.thread_env)
        env.update(self.spec.component_env.get(name, {}))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        metrics_port = self.metrics_ports.get(name, 0)
        argv = [*argv, "--metrics-port", str(metrics_port)]
        out = None
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
        )

    def _secret_env(self) -> dict[str, str]:
        env = dict(self.spec.env)
        if self.spec.redis_password:
            env["PDSERVE_REDIS_PASSWORD"] = self.spec.redis_password
        return env

    def _security_args(self) -> list[str]:
        spec = self.spec
        out = spec.tls.flags()
        if spec.redis_username:
            out += ["--redis-username", spec.redis_username]
        if spec.redis_tls_ca:
            out += ["--redis-tls-ca", spec.redis_tls_ca]
        return out

    def start(self, progress=print) -> LocalCluster:
        """Start everything and wait until every component serves; a component
        that exits meanwhile stops it all (RuntimeError). `pdserve up` instead
        calls ``launch`` and lets its supervisor watch the start-up."""
        self._wait_serving(self.launch(progress), progress)
        return self

    def launch(self, progress=print) -> list[Component]:
        """Start Redis (unless given a URL), then every node and router
        process, without waiting for them to serve."""
        spec = self.spec
        if spec.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {spec.num_routers}")
        names = ["router"] + [f"router-{i}" for i in range(1, spec.num_routers)]
        names += [f"decode-{i}" for i in range(spec.num_decode)]
        names += [f"prefill-{i}" for i in range(spec.num_prefill)]
        names += ["supervisor"] if spec.supervised else []
        self.metrics_ports = plan_metrics_ports(
            spec.metrics_port, names, lambda: free_port(spec.host)
        )
        # Before Redis and model loading: a taken port fails in one line, at once.
        check_free(
            spec.host,
            cluster_plan(spec.port, spec.admin_port, spec.http_port, self.metrics_ports),
        )
        if self.redis_url is None:
            self._start_redis(progress)
        gpus = self._gpu_count()
        for flag, tp in (("--decode-tp", spec.decode_tp), ("--prefill-tp", spec.prefill_tp)):
            if gpus and tp > gpus:
                raise ValueError(f"{flag} {tp} needs {tp} GPUs; this host shows {gpus}")
        engines = spec.num_decode * spec.decode_tp + spec.num_prefill * spec.prefill_tp
        threads = plan_threads(spec.cpu_threads, engines, gpus, os.environ)
        self.thread_env = threads.env
        if threads.reason:
            progress(threads.reason)
        return self._spawn_nodes(gpus) + self._spawn_routers()

    def _start_redis(self, progress) -> None:
        spec = self.spec
        if spec.redis_tls_ca:
            raise ValueError("--redis-tls-ca needs --redis-url: the Redis started here has no TLS")
        self.redis = RedisServer(password=spec.redis_password, username=spec.redis_username).start()
        self.redis_url = self.redis.url
        progress(f"redis-server on {self.redis_url} (pid {self.redis.process.pid})")

    def _spawn_nodes(self, gpus: int) -> list[Component]:
        """Every decode then prefill node, each on the next GPUs round the host's."""
        spec = self.spec
        common = [
            "--model",
            spec.model,
            "--redis-url",
            self.redis_url,
            "--host",
            spec.host,
            "--advertise-host",
            spec.host,
            *self._security_args(),
            "--device",
            "cuda" if gpus else "cpu",
        ]
        roles = [("decode", spec.decode_tp)] * spec.num_decode
        roles += [("prefill", spec.prefill_tp)] * spec.num_prefill
        started, slot, index = [], 0, {"decode": 0, "prefill": 0}
        for role, tp in roles:
            name = f"{role}-{index[role]}"
            index[role] += 1
            gpu = None
            if gpus:  # the next ``tp`` GPUs, round the host's
                gpu = ",".join(str((slot + k) % gpus) for k in range(tp))
                slot += tp
            port = free_port(spec.host)
            args = [role, *common, "--port", str(port), "--node-id", name]
            if role == "decode":
                args += ["--transfer-port", str(free_port(spec.host)), *spec.decode_args]
            args += [*_tp_flag(tp), *spec.engine_args, *spec.node_args]
            started.append(self._spawn(name, args, port, gpu))
        return started

    def _spawn_routers(self) -> list[Component]:
        spec = self.spec
        self.router_ports = [(spec.port, spec.admin_port)] + [
            (free_port(spec.host), free_port(spec.host)) for _ in range(spec.num_routers - 1)
        ]
        if spec.http_port:
            self.http_ports = [spec.http_port] + [
                free_port(spec.host) for _ in range(spec.num_routers - 1)
            ]
        started = []
        for i, (port, admin_port) in enumerate(self.router_ports):
            http = ["--http-port", str(self.http_ports[i])] if self.http_ports else []
            args = ["router", "--model", spec.model, "--redis-url", self.redis_url]
            args += ["--host", spec.host, "--port", str(port), "--admin-port", str(admin_port)]
            args += [*self._security_args(), *http, *spec.router_args]
            started.append(self._spawn("router" if i == 0 else f"router-{i}", args, port, None))
        return started

    def _wait_serving(self, components: list[Component], progress) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        waiting = list(components)
        while waiting:
            for c in list(waiting):
                code = c.process.poll()
                if code is not None:
                    self.stop()
                    raise RuntimeError(f"{c.name} exited with code {code} while starting")
                if health_check(c.address, timeout=0.5, tls=self.spec.tls):
                    progress(c.serving_line())
                    waiting.remove(c)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                self.stop()
                raise RuntimeError(f"{names} not serving after {self.spec.start_timeout_s:.0f} s")
            if waiting:
                time.sleep(0.25)

    def stop(self) -> None:
        for c in reversed(self.components):  # router first, decode nodes last
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_grace_s
        for c in self.components:
            try:
                c.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.process.kill()
                c.process.wait()
        self.components.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tp_flag(tp: int) -> list[str]:
    """The node flag for a tensor-parallel size; none for 1, so that a node's
    own PDSERVE_TENSOR_PARALLEL_SIZE (component_env) still counts."""
    return ["--tensor-parallel-size", str(tp)] if tp != 1 else []
