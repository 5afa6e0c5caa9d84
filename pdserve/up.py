"""`pdserve up`'s life: launch, supervise (start-up included), stop on a signal.

Start-up is supervised like the rest: a component that dies while loading is
restarted with backoff and given up on after K crashes. `pdserve up` never
hangs, though: it exits non-zero, naming the component and its log, when a
configuration error stops a component before it served (exit code 2), when
no router or no decode node is left, or when none is serving after the
start-up timeout. Ctrl-C / SIGTERM drain and stop everything (exit 0); a
second signal kills every child at once.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from common.metrics.server import serve_metrics
from pdserve.launcher import LocalCluster
from pdserve.supervisor import Stop, Supervisor, SupervisorConfig
from pdserve.supervisor_metrics import SupervisorCollector

POLL_S = 0.25


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_up(
    cluster: LocalCluster, config: SupervisorConfig, ready: Callable[[LocalCluster], None]
) -> int:
    """Run the cluster until a signal (exit 0) or a Stop (its code). ``ready``
    prints the addresses once a router and a decode node serve."""
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        if stopping:  # a second signal: stop at once
            cluster.kill_all()
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    metrics = None
    launched = False
    try:
        try:
            cluster.launch(progress=say)
        except RuntimeError as e:  # Redis did not start
            say(f"pdserve: error: {e}")
            return 1
        launched = True
        supervisor = Supervisor(cluster, config, say=say)
        port = cluster.metrics_ports.get("supervisor", 0)
        if port:
            collectors = [SupervisorCollector(supervisor)]
            metrics = serve_metrics(port, cluster.spec.host, collectors, "supervisor metrics")
        outcome = watch(cluster, supervisor, ready, lambda: stopping)
        if outcome is not None:
            say(f"pdserve: error: {outcome.message}")
            return outcome.code
        return 0
    finally:
        # Before the launch (a port already taken) the error is the one line the
        # user sees: nothing was started, so nothing is said to be stopping.
        if launched:
            say("stopping...")
        cluster.stop()
        if metrics is not None:
            metrics.close()


def watch(cluster, supervisor: Supervisor, ready, stopping) -> Stop | None:
    deadline = time.monotonic() + cluster.spec.start_timeout_s
    announced = False
    while not stopping():
        outcome = supervisor.poll()
        if outcome is not None:
            return outcome
        if not announced:
            # Ready once a router and a decode node serve and nothing is on its
            # first load (one that crashed already is in its restart loop).
            if supervisor.can_serve() and not supervisor.loading:
                announced = True
                ready(cluster)
            elif time.monotonic() > deadline:
                late = supervisor.loading
                logs = ", ".join(supervisor.log_of(n) for n in late)
                if not supervisor.can_serve():
                    return Stop(
                        1,
                        f"{', '.join(late)} not serving after "
                        f"{cluster.spec.start_timeout_s:g} s; see {logs}",
                    )
                say(f"pdserve: {', '.join(late)} still not serving; see {logs}")
                announced = True
                ready(cluster)
        time.sleep(POLL_S)
    return None
