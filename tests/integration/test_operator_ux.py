"""What an operator sees (issue #22), on real processes: start-up failures in
one line, requests that cannot fit refused, wrong addresses explained, a log
that says what the cluster serves, and a fast `pdserve generate`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc
from proto.client import generate

pytestmark = pytest.mark.timeout(600)

MAX_LEN = 256
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
PDCTL = [sys.executable, "-m", "router.admin.pdctl"]
REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def run(argv, timeout=120, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV, **kw)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model=str(demo_model_dir),
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", str(MAX_LEN)],
        router_args=["--max-model-len", str(MAX_LEN)],
        # A small host tier on every node: what pdctl shows of it (it fills
        # only when the KV pool evicts, which these tests' prompts never make it).
        node_args=["--log-stats-interval", "1", "--swap-space", "0.05"],
        log_dir=str(tmp_path_factory.mktemp("ux-logs")),
        start_timeout_s=300,
    )
    with LocalCluster(spec) as c:
        yield c


def log_of(cluster, name: str) -> str:
    return (Path(cluster.spec.log_dir) / f"{name}.log").read_text()


def status_counts(cluster) -> dict[str, int]:
    with grpc.insecure_channel(cluster.admin_address) as ch:
        s = admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5)
    return {c.status: c.count for c in s.requests_by_status}


# ------------------------------------------------------------ 1. taken ports
@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_up_names_a_taken_port_and_its_flag_before_starting_anything(demo_model_dir, taken_port):
    start = time.monotonic()
    out = run(
        [*PDSERVE, "up", "--model", str(demo_model_dir), "--port", str(taken_port)]
        + ["--admin-port", str(free_port()), "--metrics-port", "0"]
    )
    assert out.returncode == 2, out.stderr  # a configuration error, like a bad flag
    assert time.monotonic() - start < 20  # no model was loaded
    assert "Traceback" not in out.stderr
    assert "redis-server" not in out.stderr  # nothing was started
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"{taken_port} (router public API; change it with --port)" in lines[0]


def test_up_checks_the_metrics_ports_too(demo_model_dir, taken_port):
    # The router's metrics port is the base; the taken one is the decode node's (base + 1).
    out = run(
        [*PDSERVE, "up", "--model", str(demo_model_dir), "--port", str(free_port())]
        + ["--admin-port", str(free_port()), "--metrics-port", str(taken_port - 1)]
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{taken_port} (decode-0 metrics; change it with --metrics-port)" in out.stderr


def test_up_checks_the_http_port_too(demo_model_dir, taken_port):
    out = run(
        [*PDSERVE, "up", "--model", str(demo_model_dir), "--port", str(free_port())]
        + ["--admin-port", str(free_port()), "--metrics-port", "0", "--http-port", str(taken_port)]
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{taken_port} (router OpenAI HTTP API; change it with --http-port)" in out.stderr


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
def test_a_component_on_a_taken_port_fails_in_one_line(demo_model_dir, taken_port, component):
    out = run(
        [*PDSERVE, component, "--model", str(demo_model_dir), "--host", "127.0.0.1"]
        + ["--port", str(taken_port), "--metrics-port", "0", "--redis-url", "redis://127.0.0.1:1"]
        # The router's admin API: a free port, not the default another test's cluster may hold.
        + (["--admin-port", str(free_port())] if component == "router" else [])
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: error: port already in use") and "--port" in last, last


# ------------------------------------------------------ 2. requests that cannot fit
def test_an_explicit_max_tokens_beyond_the_context_is_refused(cluster):
    with pytest.raises(grpc.RpcError) as info:
        list(generate(cluster.router_address, token_ids=[1000] * 200, max_tokens=100, timeout=30))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert (
        "200" in details and "max_tokens 100" in details and f"max_model_len {MAX_LEN}" in details
    )
    # Exactly the context still runs, and an unset max_tokens is not checked.
    ok = list(generate(cluster.router_address, token_ids=[1000] * 254, max_tokens=2, timeout=120))
    assert ok[-1].final.usage.completion_tokens == 2
    ok = list(generate(cluster.router_address, token_ids=[1000] * 250, timeout=120))
    assert ok[-1].final.usage.completion_tokens >= 1


def test_a_deadline_names_the_timeout_flag_and_counts_as_a_deadline(cluster):
    before = status_counts(cluster)
    out = run(
        [*PDSERVE, "generate", "Tell me a very long story.", "--address", cluster.router_address]
        + ["--max-tokens", "200", "--ignore-eos", "--timeout", "1.5"]
    )
    assert out.returncode == 1
    assert "DEADLINE_EXCEEDED" in out.stderr and "--timeout (1.5 s" in out.stderr, out.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = status_counts(cluster)
        if after.get("DEADLINE_EXCEEDED", 0) > before.get("DEADLINE_EXCEEDED", 0):
            break
        time.sleep(0.2)
    assert after.get("DEADLINE_EXCEEDED", 0) == before.get("DEADLINE_EXCEEDED", 0) + 1, after
    assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0), after


# ------------------------------------------------ 3. wrong port, broken pipe, 404
def test_generate_at_the_admin_port_says_so(cluster):
    out = run([*PDSERVE, "generate", "Hi", "--address", cluster.admin_address])
    assert out.returncode == 1
    assert "UNIMPLEMENTED" not in out.stderr
    assert f"{cluster.admin_address} serves the admin API" in out.stderr, out.stderr
    assert "50051" in out.stderr


def test_pdctl_into_a_closed_pipe_exits_quietly(cluster):
    pdctl = subprocess.Popen(
        [*PDCTL, "--address", cluster.admin_address, "stats", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    pdctl.stdout.close()  # what `| head` does once it has its lines
    _, err = pdctl.communicate(timeout=60)
    assert pdctl.returncode == 0, err
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_metrics_answer_404_off_their_path(cluster):
    url = next(c for c in cluster.components if c.name == "router").metrics_url
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200 and b"pdserve_router_requests_total" in r.read()
    for path in ("/", "/metricsx", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url.removesuffix("/metrics") + path, timeout=5)
        assert info.value.code == 404


# ------------------------------------------------ 4. access log, progress lines
def test_the_router_logs_each_request_and_nodes_log_progress(cluster):
    list(
        generate(
            cluster.router_address,
            "Count to twenty.",
            request_id="access-log-1",
            max_tokens=40,
            ignore_eos=True,
            timeout=120,
        )
    )
    deadline = time.monotonic() + 10
    while "request access-log-1: OK" not in log_of(cluster, "router"):
        assert time.monotonic() < deadline, log_of(cluster, "router")[-2000:]
        time.sleep(0.2)
    line = next(x for x in log_of(cluster, "router").splitlines() if "access-log-1" in x)
    assert "completion 40 tokens" in line and "TTFT" in line and "decode decode-0" in line, line
    # Busy for a few seconds with --log-stats-interval 1: at least one line.
    decode_log = log_of(cluster, "decode-0")
    progress = [x for x in decode_log.splitlines() if "generation" in x and "tok/s" in x]
    assert progress, decode_log[-2000:]
    assert "KV usage" in progress[-1] and "prefix hits" in progress[-1]


def test_no_access_log_flag_is_accepted():
    import argparse

    from router.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--no-access-log"]).no_access_log is True
    assert p.parse_args([]).no_access_log is False


# ---------------------------------------------------------- 6. pdserve generate
def test_generate_help_shows_every_default_and_the_sampling_flags():
    out = run([*PDSERVE, "generate", "--help"])
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in ("--top-p", "--top-k", "--min-p", "--stop", "--n", "--logprobs", "--ignore-eos"):
        assert flag in text
    assert "(default: 128)" in text and "(default: 120.0)" in text
    assert "(default: 127.0.0.1:50051)" in text


def test_generate_imports_neither_torch_nor_the_engine(cluster):
    code = (
        "import sys\n"
        "from pdserve import cli\n"
        f"rc = cli.main(['generate', 'Hi', '--address', '{cluster.router_address}', "
        "'--max-tokens', '2', '--top-k', '5', '--stop', 'zzz', '--n', '2', '--logprobs', '1'])\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('engine'))\n"
        "print('RC', rc, 'HEAVY', heavy)\n"
    )
    out = run([sys.executable, "-c", code])
    assert "RC 0 HEAVY []" in out.stdout, (out.stdout, out.stderr)
    assert "[0] " in out.stdout and "[1] " in out.stdout  # --n 2: both completions
    assert "logprob" in out.stdout


def test_command_name_finds_a_runnable_pdserve():
    from pdserve.generate import command_name

    name = command_name("pdserve", "pdserve.cli")
    assert name == "pdserve" or name.endswith("pdserve") or name.endswith("-m pdserve.cli")
    assert command_name("no-such-script", "x.y").endswith("-m x.y")


# ------------------------------------------------------------------ 5. pdctl top
def test_pdctl_top_renders_every_node_and_the_latencies(cluster):
    list(generate(cluster.router_address, "Name a fruit.", max_tokens=4, timeout=120))
    out = run([*PDCTL, "--address", cluster.admin_address, "top", "--once", "--interval", "0.5"])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in (
        "decode-0",
        "prefill-0",
        "KV USAGE",
        "HOST USAGE",
        "TOK/S",
        "HEARTBEAT",
        "TTFT",
        "TPOT",
        "ITL",
    ):
        assert expected in text, text
    assert "requests/s" in text and "%" in text
    ttft = next(line for line in text.splitlines() if "TTFT" in line)
    assert any(ch.isdigit() for ch in ttft.replace("TTFT", "")), ttft


def test_pdctl_nodes_shows_each_nodes_host_tier(cluster):
    out = run([*PDCTL, "--address", cluster.admin_address, "nodes", "--json"])
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)
    assert {n["node_id"] for n in nodes} == {"prefill-0", "decode-0"}
    for n in nodes:
        # 0.05 GiB of slots, each one KV block of the demo model; all free at idle.
        assert n["host_kv_blocks_total"] > 0, n
        assert n["host_kv_blocks_free"] == n["host_kv_blocks_total"], n
        assert "host_cached_blocks" in n


def test_pdctl_top_frame_from_samples():
    from proto import admin_pb2
    from router.admin.top import Sample, render_text

    node = admin_pb2.NodeInfo(
        node_id="decode-9", role="decode", kv_blocks_total=100, kv_blocks_free=25, running=3
    )
    later = admin_pb2.NodeInfo()
    later.CopyFrom(node)
    later.requests_total = 20
    later.computed_tokens_total = 1234
    stats = admin_pb2.StatsResponse()
    text = render_text(Sample(0.0, [node], stats), Sample(2.0, [later], stats), "host:1")
    assert "decode-9" in text and " 75%" in text and "TOK/S" in text
    assert "10.0" in text  # 20 requests in 2 s
    assert "617" in text  # 1234 tokens through the model in 2 s


def test_pdctl_top_runs_full_screen_in_a_terminal_and_q_quits(cluster):
    # A real pseudo-terminal: the live view draws, and the q key ends it.
    import pty
    import select as select_

    pid, fd = pty.fork()
    if pid == 0:  # the child: pdctl top on a terminal wide enough for every column
        env = dict(os.environ, COLUMNS="200", LINES="50")
        os.execve(sys.executable, [*PDCTL, "--address", cluster.admin_address, "top"], env)
    screen = b""
    try:
        deadline = time.monotonic() + 30
        while b"decode-0" not in screen and time.monotonic() < deadline:
            if select_.select([fd], [], [], 0.5)[0]:
                screen += os.read(fd, 65536)
        assert b"decode-0" in screen and b"TOK/S" in screen, screen[-2000:]
        os.write(fd, b"q")
        end = time.monotonic() + 10
        status = None
        while status is None and time.monotonic() < end:
            if select_.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    os.read(fd, 65536)
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
        assert status is not None, "pdctl top did not quit on q"
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
