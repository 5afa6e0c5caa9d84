"""Security on a live `pdserve up`: TLS with client certificates (mTLS) on every
gRPC hop, API tokens with rights on the router, the admin token on its own
port, a password-protected Redis, reflection, token rotation. One cluster for
the module (1 prefill + 1 decode node, remote prefill forced so that the
decode -> prefill hop is taken); extra router processes where a test needs a
different configuration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.grpc_server import health_check, wait_serving
from common.tls import TLSConfig, make_sync_channel
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc, internal_pb2, internal_pb2_grpc
from proto.client import channel_credentials, generate, generate_text
from tests.certs import make_certs
from tests.pdserve_up import UpProcess

pytestmark = pytest.mark.timeout(600)

ALICE = "alice-generate-0123456789"  # generate
VIEWER = "viewer-read-0123456789"  # admin:read
OPS = "ops-everything-0123456789"  # generate,admin
CAROL = "carol-rotated-in-0123456789"
ADMIN_TOKEN = "the-admin-token-0123456789"
REDIS_PASSWORD = "redis-password-0123456789"
MAX_LEN = 512


def tokens_text(*lines: str) -> str:
    return "# NAME RIGHTS TOKEN\n" + "\n".join(lines) + "\n"


BASE_TOKENS = tokens_text(
    f"alice generate {ALICE}", f"viewer admin:read {VIEWER}", f"ops generate,admin {OPS}"
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def client_tls(certs) -> TLSConfig:
    """What a trusted client holds: the CA and a certificate the cluster's CA signed."""
    return TLSConfig.from_paths(cert=certs.cert, key=certs.key, ca=certs.ca)


class Up(UpProcess):
    """The secure `pdserve up`, with its tokens file and log directory."""

    def __init__(self, args, env, unset, tokens: Path, logs: Path) -> None:
        super().__init__(args, env, unset)
        self.tokens = tokens
        self.logs = logs


@pytest.fixture(scope="module")
def up(demo_model_dir, certs, tmp_path_factory):
    work = tmp_path_factory.mktemp("secure-up")
    tokens = work / "tokens"
    tokens.write_text(BASE_TOKENS)
    logs = work / "logs"
    env = dict(
        # Secrets through the environment, as a deployment would pass them.
        PDSERVE_ADMIN_TOKEN=ADMIN_TOKEN,
        PDSERVE_REDIS_PASSWORD=REDIS_PASSWORD,
        PDSERVE_HEARTBEAT_S="0.2",
        # Every request prefilled on the prefill node: the decode -> prefill hop.
        PDSERVE_LOCAL_PREFILL_MAX_TOKENS="0",
        PDSERVE_LOCAL_PREFILL_MIN_HIT="1.0",
    )
    cluster = Up(
        ["--model", str(demo_model_dir)]
        + ["--prefill", "1", "--decode", "1", "--max-model-len", str(MAX_LEN)]
        + ["--port", str(free_port()), "--admin-port", str(free_port())]
        + ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
        + ["--tls-ca", str(certs.ca), "--tls-client-ca", str(certs.ca)]
        + ["--api-tokens-file", str(tokens), "--log-dir", str(logs)],
        env,
        unset=["PDSERVE_REFLECTION"],
        tokens=tokens,
        logs=logs,
    )
    cluster.wait_ready()
    yield cluster
    cluster.stop(timeout=60)


def call_generate(address: str, tls: TLSConfig | None, token: str | None, **kw):
    """(text, final) or the grpc.RpcError raised."""
    channel = make_sync_channel(address, tls) if tls else grpc.insecure_channel(address)
    try:
        return generate_text(
            address, "Name a colour.", max_tokens=4, timeout=60, token=token, channel=channel, **kw
        )
    except grpc.RpcError as e:
        return e
    finally:
        channel.close()


def node_addresses(up, client_tls) -> dict[str, str]:
    with make_sync_channel(up.admin, client_tls) as ch:
        nodes = admin_pb2_grpc.AdminStub(ch).ListNodes(
            admin_pb2.ListNodesRequest(),
            timeout=10,
            metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
        )
    return {n.node_id: n.address for n in nodes.nodes}


def pdctl(up, *args: str, token: str | None = ADMIN_TOKEN, tls: list[str] | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    if token:
        env["PDCTL_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "router.admin.pdctl", "--address", up.admin, *(tls or []), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def pdctl_tls(certs) -> list[str]:
    return ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]


# ------------------------------------------------------------------ public API
def test_tokens_on_the_public_api(up, client_tls):
    missing = call_generate(up.router, client_tls, None)
    assert missing.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "missing token" in missing.details()
    bad = call_generate(up.router, client_tls, "not-a-token-0123456789")
    assert bad.code() is grpc.StatusCode.UNAUTHENTICATED and bad.details() == "unknown token"
    no_right = call_generate(up.router, client_tls, VIEWER)
    assert no_right.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "'viewer' lacks the 'generate' right" in no_right.details()

    # The right token: served end to end, every hop over mTLS, KV from the prefill node.
    text, final = call_generate(up.router, client_tls, ALICE)
    assert text and final.usage.completion_tokens >= 1
    assert final.usage.prefill_node == "prefill-0" and final.usage.decode_node == "decode-0"


def test_the_router_refuses_clients_without_tls_or_a_trusted_certificate(up, certs, client_tls):
    # Each refusal is TLS's: the same call with the right credentials passes (above).
    plaintext = call_generate(up.router, None, ALICE)
    assert plaintext.code() is grpc.StatusCode.UNAVAILABLE
    no_client_cert = TLSConfig.from_paths(ca=certs.ca)
    assert call_generate(up.router, no_client_cert, ALICE).code() is grpc.StatusCode.UNAVAILABLE
    stranger = TLSConfig.from_paths(cert=certs.other_cert, key=certs.other_key, ca=certs.ca)
    assert call_generate(up.router, stranger, ALICE).code() is grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the router's CA does not talk to it either.
    wrong_ca = TLSConfig.from_paths(cert=certs.cert, key=certs.key, ca=certs.other_ca)
    assert call_generate(up.router, wrong_ca, ALICE).code() is grpc.StatusCode.UNAVAILABLE

    # proto.client's own credentials work the same way.
    creds = channel_credentials(ca=certs.ca, cert=certs.cert, key=certs.key)
    finals = [
        r.final
        for r in generate(up.router, "Hi", max_tokens=2, token=ALICE, credentials=creds, timeout=60)
        if r.HasField("final")
    ]
    assert len(finals) == 1


def test_health_checks_speak_tls(up, client_tls):
    assert health_check(up.router, "pdserve.v1.Router", tls=client_tls)
    assert health_check(up.admin, "pdserve.v1.Admin", tls=client_tls)  # no token needed
    assert not health_check(up.router, "pdserve.v1.Router", timeout=2)  # plaintext


def test_internal_hops_want_a_client_certificate(up, certs, client_tls):
    """Nodes take calls only from holders of a certificate the cluster's CA signed."""
    nodes = node_addresses(up, client_tls)
    assert set(nodes) == {"decode-0", "prefill-0"}
    for address in nodes.values():
        assert health_check(address, tls=client_tls)
        assert not health_check(address, timeout=2)
        anonymous = TLSConfig.from_paths(ca=certs.ca)
        assert not health_check(address, timeout=2, tls=anonymous)
        with make_sync_channel(address, anonymous) as ch, pytest.raises(grpc.RpcError) as info:
            internal_pb2_grpc.NodeControlStub(ch).FlushCache(
                internal_pb2.NodeFlushRequest(), timeout=10
            )
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_the_exec_health_probe_uses_the_components_tls_variables(up, certs, client_tls):
    decode = node_addresses(up, client_tls)["decode-0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    probe = [sys.executable, "-m", "common.health_probe", "--address", decode]

    def run(extra_env):
        return subprocess.run(probe, env={**env, **extra_env}, capture_output=True, timeout=60)

    # A pod's own variables, as a Kubernetes exec probe would inherit them.
    pod = {
        "PDSERVE_TLS_CERT": str(certs.cert),
        "PDSERVE_TLS_KEY": str(certs.key),
        "PDSERVE_TLS_CA": str(certs.ca),
        "PDSERVE_TLS_CLIENT_CA": str(certs.ca),
    }
    assert run(pod).returncode == 0
    assert run({}).returncode == 1  # plaintext: refused
    assert run({"PDSERVE_TLS_CA": str(certs.ca)}).returncode == 1  # no client certificate


def test_pdserve_generate_with_token_and_tls(up, certs):
    base = [sys.executable, "-m", "pdserve.cli", "generate", "Name a fruit."]
    base += ["--address", up.router, "--max-tokens", "3", "--timeout", "60"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    ok = subprocess.run(
        [*base, "--token", ALICE, *pdctl_tls(certs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "prefill: prefill-0" in ok.stderr
    # The environment works as well as the flags.
    env_tls = dict(
        env,
        PDSERVE_TOKEN=VIEWER,
        PDSERVE_TLS_CA=str(certs.ca),
        PDSERVE_TLS_CERT=str(certs.cert),
        PDSERVE_TLS_KEY=str(certs.key),
    )
    denied = subprocess.run(base, capture_output=True, text=True, env=env_tls, timeout=120)
    assert denied.returncode == 1
    assert denied.stderr.strip().startswith("pdserve: error: PERMISSION_DENIED")
    bad_flags = subprocess.run(
        [*base, "--tls-ca", str(certs.ca), "--tls-key", str(certs.key)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad_flags.returncode == 2
    assert bad_flags.stderr.strip() == (
        "pdserve: error: --tls-cert and --tls-key go together: give both or neither"
    )


# ------------------------------------------------------------------- admin API
def test_admin_api_takes_the_admin_token_and_scoped_tokens(up, certs):
    tls = pdctl_tls(certs)
    r = pdctl(up, "--json", "nodes", tls=tls)
    assert r.returncode == 0, r.stderr
    assert '"decode-0"' in r.stdout
    # Scoped tokens from the tokens file: admin:read lists but may not change anything.
    assert pdctl(up, "nodes", token=VIEWER, tls=tls).returncode == 0
    drain = pdctl(up, "drain", "decode-0", token=VIEWER, tls=tls)
    assert drain.returncode == 4
    assert "'viewer' lacks the 'admin' right" in drain.stderr
    assert pdctl(up, "nodes", token=ALICE, tls=tls).returncode == 4  # generate only
    assert pdctl(up, "nodes", token=None, tls=tls).returncode == 4
    assert pdctl(up, "nodes", token="wrong-token-0123456789", tls=tls).returncode == 4
    # A token with the admin right operates: flush goes on to the node's NodeControl (mTLS).
    flush = pdctl(up, "flush", "prefill-0", token=OPS, tls=tls)
    assert flush.returncode == 0, flush.stderr
    assert "cached blocks evicted" in flush.stdout
    # Without TLS the admin port does not answer at all.
    plain = pdctl(up, "nodes", tls=[])
    assert plain.returncode == 3 and "--tls-ca" in plain.stderr


# ------------------------------------------------------------------ reflection
def reflection_services(address: str, tls: TLSConfig, token: str | None) -> list[str]:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with make_sync_channel(address, tls) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata)
        return [s.name for r in responses for s in r.list_services_response.service]


def test_reflection_is_off_by_default(up, client_tls):
    for address in [up.router, *node_addresses(up, client_tls).values()]:
        with pytest.raises(grpc.RpcError) as info:
            reflection_services(address, client_tls, ALICE)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED, address


def start_router(up, demo_model_dir, certs, *extra: str, env_extra: dict | None = None):
    """Another router on the cluster's Redis; returns (process, address)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(env_extra or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--model", str(demo_model_dir)]
        + ["--host", "127.0.0.1", "--port", str(port), "--admin-port", str(free_port())]
        + ["--redis-url", up.redis_url, "--max-model-len", str(MAX_LEN)]
        + ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
        + ["--tls-ca", str(certs.ca), "--tls-client-ca", str(certs.ca), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, f"127.0.0.1:{port}"


def test_reflection_when_enabled_wants_a_token(up, demo_model_dir, certs, client_tls):
    proc, address = start_router(
        up,
        demo_model_dir,
        certs,
        "--enable-reflection",
        "--api-tokens-file",
        str(up.tokens),
        env_extra={"PDSERVE_REDIS_PASSWORD": REDIS_PASSWORD},
    )
    try:
        assert wait_serving(address, 120, "pdserve.v1.Router", tls=client_tls), proc.poll()
        assert "pdserve.v1.Router" in reflection_services(address, client_tls, VIEWER)
        with pytest.raises(grpc.RpcError) as info:
            reflection_services(address, client_tls, None)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # This router serves the same cluster: a request goes end to end.
        _, final = call_generate(address, client_tls, ALICE)
        assert final.usage.decode_node == "decode-0" and final.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


# ----------------------------------------------------------------------- Redis
@pytest.mark.parametrize(
    ("password", "message"),
    [
        (None, "wants a password: set --redis-password / PDSERVE_REDIS_PASSWORD"),
        ("wrong-password", "refused the credentials (invalid username-password pair"),
    ],
)
def test_a_component_without_the_redis_password_fails_clearly(
    up, demo_model_dir, certs, password, message
):
    extra = {"PDSERVE_REDIS_PASSWORD": password} if password else {}
    proc, _ = start_router(up, demo_model_dir, certs, env_extra=extra)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pdserve: error: Redis at {up.redis_url} "), err
    assert message in last
    assert password is None or password not in err


def test_bad_tls_flags_fail_before_anything_loads(up, demo_model_dir, certs, tmp_path):
    proc, _ = start_router(up, demo_model_dir, certs, "--tls-client-ca", str(tmp_path / "nope"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == (
        f"pdserve: error: --tls-client-ca: no such file: {tmp_path / 'nope'}"
    )


# ------------------------------------------------------------- token rotation
def test_tokens_rotate_without_a_restart(up, client_tls):
    try:
        staged = up.tokens.with_suffix(".new")
        staged.write_text(tokens_text(f"carol generate {CAROL}", f"ops generate,admin {OPS}"))
        os.replace(staged, up.tokens)  # atomic, as a Kubernetes secret update is
        deadline = time.monotonic() + 10
        while isinstance(result := call_generate(up.router, client_tls, CAROL), grpc.RpcError):
            assert result.code() is grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "the new token was not picked up"
            time.sleep(0.2)
        assert result[1].usage.completion_tokens >= 1
        gone = call_generate(up.router, client_tls, ALICE)
        assert gone.code() is grpc.StatusCode.UNAUTHENTICATED
        # A broken edit keeps the tokens that work.
        up.tokens.write_text("carol generate\n")
        time.sleep(1.5)
        assert not isinstance(call_generate(up.router, client_tls, CAROL), grpc.RpcError)
        router_log = (up.logs / "router.log").read_text()
        assert "tokens file not reloaded, keeping the tokens loaded" in router_log
    finally:
        up.tokens.write_text(BASE_TOKENS)


def test_sigterm_stops_the_secure_cluster_cleanly(up, client_tls):
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=90) == 0
    assert not health_check(up.router, "pdserve.v1.Router", timeout=1, tls=client_tls)
