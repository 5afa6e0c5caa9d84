"""The supervisor's policy on real (tiny) processes: one line per restart with
its backoff, given up after K exits, configuration errors and the loss of the
last decode node stop `pdserve up`, `--no-restart` stops at the first exit.

Each component here is a Python process that exits with a chosen code after a
chosen time (LocalCluster._popen overridden): the policy, not model loading.
The whole path through `pdserve up` is tests/faults/test_self_healing.py.
"""

from __future__ import annotations

import subprocess
import sys

from pdserve.launcher import ClusterSpec, Component, LocalCluster
from pdserve.supervisor import Health, Supervisor, SupervisorConfig

EXIT_AFTER = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"


class ScriptedCluster(LocalCluster):
    """Components that exit with ``codes[name]`` after ``lives[name]`` seconds."""

    def __init__(self, codes: dict[str, int], lives: dict[str, float], log_dir=None) -> None:
        super().__init__(ClusterSpec(model="unused", log_dir=log_dir))
        self.codes, self.lives = codes, lives
        for name in codes:
            role = name.split("-")[0]
            # Port 9 (discard): nothing answers a health check there.
            self.components.append(
                Component(name, "127.0.0.1:9", self._popen(name, [role], None), [role])
            )

    def _popen(self, name, argv, gpu):
        life, code = str(self.lives.get(name, 60)), str(self.codes[name])
        return subprocess.Popen([sys.executable, "-c", EXIT_AFTER, life, code])

    def wait_exits(self, *names: str) -> None:
        for c in self.components:
            if c.name in names:
                c.process.wait(30)


def supervise(cluster, **config) -> tuple[Supervisor, list[str]]:
    lines: list[str] = []
    return Supervisor(cluster, SupervisorConfig(**config), say=lines.append), lines


def test_restarts_with_backoff_one_line_each_then_gives_up(tmp_path):
    cluster = ScriptedCluster(
        {"router": 0, "decode-0": 0, "decode-1": 1},
        {"decode-1": 0},
        log_dir=str(tmp_path),
    )
    sup, lines = supervise(cluster, backoff_s=1, max_backoff_s=30, max_crashes=2, window_s=60)
    try:
        t = 1000.0
        for n, delay in ((1, 1), (2, 2)):
            cluster.wait_exits("decode-1")
            assert sup.poll(now=t) is None
            assert lines[-1].startswith(f"pdserve: decode-1 (pid {sup._process('decode-1').pid})")
            assert lines[-1].endswith(
                f"exited with code 1; restarting in {delay} s (restart {n} of 2 in 60 s)"
            )
            assert len(lines) == n  # one line per restart, nothing else
            assert sup.watches["decode-1"].state is Health.WAITING
            sup.poll(now=t + delay - 0.01)  # not yet
            assert sup.restarts()["decode-1"] == n - 1
            sup.poll(now=t + delay)
            assert sup.restarts()["decode-1"] == n
            t += delay
        cluster.wait_exits("decode-1")
        assert sup.poll(now=t) is None  # decode-0 still serves: the rest keep going
        assert sup.given_up == ["decode-1"]
        assert lines[-1] == (
            f"pdserve: giving up on decode-1: it exited 3 times within 60 s (last code 1); "
            f"see {tmp_path}/decode-1.log. The rest keep serving."
        )
        assert len(lines) == 3
    finally:
        cluster.kill_all()


def test_crashes_outside_the_window_are_forgotten():
    cluster = ScriptedCluster({"router": 0, "decode-0": 1}, {"decode-0": 0})
    sup, lines = supervise(cluster, backoff_s=1, max_crashes=1, window_s=10)
    try:
        for t in (0.0, 20.0, 40.0):  # one crash per window: never given up
            cluster.wait_exits("decode-0")
            sup.poll(now=t)
            assert lines[-1].endswith("restarting in 1 s (restart 1 of 1 in 10 s)")
            sup.poll(now=t + 1)
        assert sup.given_up == [] and sup.restarts()["decode-0"] == 3
    finally:
        cluster.kill_all()


def test_a_configuration_error_before_serving_stops_at_once(tmp_path):
    cluster = ScriptedCluster({"router": 0, "decode-0": 2}, {"decode-0": 0}, log_dir=str(tmp_path))
    sup, lines = supervise(cluster)
    try:
        cluster.wait_exits("decode-0")
        stop = sup.poll()
        assert stop is not None and stop.code == 2
        assert "decode-0 exited with code 2 (a configuration error" in stop.message
        assert f"{tmp_path}/decode-0.log" in stop.message
        assert lines == [] and sup.restarts()["decode-0"] == 0
    finally:
        cluster.kill_all()


def test_exit_code_2_after_serving_is_restarted_like_any_crash():
    cluster = ScriptedCluster({"router": 0, "decode-0": 2}, {"decode-0": 0})
    sup, lines = supervise(cluster)
    sup.watches["decode-0"].served = True  # it served before: a port taken since, say
    try:
        cluster.wait_exits("decode-0")
        assert sup.poll() is None
        assert "decode-0" in lines[0] and "restarting in 1 s" in lines[0]
    finally:
        cluster.kill_all()


def test_losing_the_last_decode_node_stops_pdserve_up(tmp_path):
    cluster = ScriptedCluster({"router": 0, "decode-0": 1}, {"decode-0": 0}, log_dir=str(tmp_path))
    sup, lines = supervise(cluster, max_crashes=0)
    try:
        cluster.wait_exits("decode-0")
        stop = sup.poll()
        assert lines[0].startswith("pdserve: giving up on decode-0")
        assert stop is not None and stop.code == 1
        assert (
            stop.message == f"no decode node left to serve (see {tmp_path}/decode-0.log); stopping"
        )
    finally:
        cluster.kill_all()


def test_no_restart_stops_at_the_first_exit():
    cluster = ScriptedCluster({"router": 0, "prefill-0": 1}, {"prefill-0": 0})
    sup, lines = supervise(cluster, restart=False)
    try:
        cluster.wait_exits("prefill-0")
        stop = sup.poll()
        assert stop is not None and stop.code == 1
        assert stop.message.startswith("prefill-0 exited with code 1")
        assert lines == [] and sup.restarts()["prefill-0"] == 0
    finally:
        cluster.kill_all()
