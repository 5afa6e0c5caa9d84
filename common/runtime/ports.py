"""Ports a process or `pdserve up` will listen on: checked before anything
loads, and a failed bind said in one line naming the flag that changes it.

Start-up loads the model first (tens of seconds), so a port someone else
holds must be found before, not after: `check_free` binds each planned port
once and lets it go. A plan is a list of ``PlannedPort``s so that a new
listener (an HTTP front, say) is one more entry, not new code.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.tls import NO_TLS, TLSConfig, add_port


@dataclass(slots=True, frozen=True)
class PlannedPort:
    port: int
    flag: str  # the command-line flag that changes it
    what: str  # who listens there, e.g. "router public API"

    def describe(self) -> str:
        return f"{self.port} ({self.what}; change it with {self.flag})"


class PortInUse(ValueError):
    """A port cannot be listened on. A ValueError: the CLIs print it as one
    line (configuration, not a crash)."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _is_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as servers set it: a port in TIME_WAIT is free to them,
        # a port someone listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


# Where free_port looks: below the kernel's ephemeral range. A port from that
# range (what binding port 0 gives) is also what every outgoing connection
# gets, and a cluster binds its planned ports only after loading its model,
# seconds later: in CI a node's port was once taken in between by some
# process's connection, and the node exited "port in use".
LOWEST_PICKED_PORT = 15000
# Ports this process has handed out: two picks before either is bound must
# differ (nothing is listening on either yet).
_picked: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere port 0 decides below


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range when it can be."""
    return free_port_block(1, host)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive ports nothing listens on now (`pdserve up
    --metrics-port` takes such a block), below the ephemeral range when it can be."""
    low = _ephemeral_low()
    if low - LOWEST_PICKED_PORT >= 1000:
        base = _pick_block(n, host, LOWEST_PICKED_PORT, low)
        if base is not None:
            return base
    if n == 1:  # no room below the range: the kernel's choice
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _picked.add(port)
        return port
    base = _pick_block(n, host, 20000, 60000)
    if base is None:
        raise RuntimeError(f"no {n} consecutive free ports on {host}")
    return base


def _pick_block(n: int, host: str, lo: int, hi: int) -> int | None:
    """A random block of ``n`` ports in [lo, hi), none handed out before, all free."""
    for _ in range(200):
        base = random.randrange(lo, hi - n + 1)
        block = range(base, base + n)
        if _picked.isdisjoint(block) and all(_is_free(host, p) for p in block):
            _picked.update(block)
            return base
    return None


def taken(host: str, planned: Iterable[PlannedPort]) -> list[PlannedPort]:
    """The planned ports (non-zero) that cannot be bound on ``host`` now."""
    return [p for p in planned if p.port and not _is_free(host, p.port)]


def check_free(host: str, planned: Iterable[PlannedPort]) -> None:
    """Raise PortInUse naming every taken port and its flag, in one line."""
    planned = list(planned)
    ports = [p.port for p in planned if p.port]
    dupes = sorted({p for p in ports if ports.count(p) > 1})
    if dupes:
        users = "; ".join(p.describe() for p in planned if p.port in dupes)
        raise PortInUse(f"the same port is planned twice: {users}")
    busy = taken(host, planned)
    if busy:
        raise PortInUse(
            f"port{'s' if len(busy) > 1 else ''} already in use on {host}: "
            + "; ".join(p.describe() for p in busy)
        )


def listen(
    server: grpc.aio.Server, host: str, port: int, flag: str, what: str, tls: TLSConfig = NO_TLS
) -> int:
    """``add_port`` that fails with one line (PortInUse) instead of gRPC's
    RuntimeError and its traceback."""
    try:
        return add_port(server, f"{host}:{port}", tls)
    except RuntimeError as e:
        raise PortInUse(
            f"cannot listen on {host}:{port} for the {what} (is the port taken? "
            f"change it with {flag}): {e}"
        ) from None


def router_listeners(port: int, admin_port: int, http_port: int | None) -> list[PlannedPort]:
    """A router's listeners: gRPC public and admin, and the OpenAI HTTP API when on
    (one list for the router's own check and `pdserve up`'s)."""
    plan = [
        PlannedPort(port, "--port", "router public API"),
        PlannedPort(admin_port, "--admin-port", "router admin API"),
    ]
    if http_port:
        plan.append(PlannedPort(http_port, "--http-port", "router OpenAI HTTP API"))
    return plan


def cluster_plan(
    port: int, admin_port: int, http_port: int | None, metrics_ports: dict[str, int]
) -> list[PlannedPort]:
    """What `pdserve up` listens on at fixed ports (the rest are picked free)."""
    return router_listeners(port, admin_port, http_port) + [
        PlannedPort(p, "--metrics-port", f"{name} metrics")
        for name, p in metrics_ports.items()
        if p
    ]
