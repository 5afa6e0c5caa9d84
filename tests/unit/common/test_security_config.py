"""Security configuration without servers: the tokens file (format, rights,
rotation), TLS flags and Redis options, each with the error a person sees."""

from __future__ import annotations

import argparse
import hashlib
import os

import grpc
import pytest

from common.auth import (
    ADMIN,
    ADMIN_READ,
    ANY,
    GENERATE,
    OPEN,
    StaticToken,
    TokenAuthInterceptor,
    TokenFile,
    bearer_token,
    parse_tokens,
    required_right,
)
from common.cluster.redis_auth import redacted, redis_options
from common.tls import TLSConfig, add_tls_arguments
from tests.certs import make_certs

ALICE = "alice-token-0123456789"
OPS = "ops-token-0123456789abc"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


# ----------------------------------------------------------------- tokens file
def test_tokens_file_format_rights_and_digests():
    text = f"""
    # NAME  RIGHTS  TOKEN
    alice   generate          {ALICE}

    ops     generate,admin    sha256:{hashlib.sha256(OPS.encode()).hexdigest()}
    viewer  admin:read        viewer-token-0123456789
    root    *                 root-token-0123456789abc
    """
    tokens = parse_tokens(text, "tokens")
    by_name = {p.name: p for p in tokens.values()}
    assert set(by_name) == {"alice", "ops", "viewer", "root"}
    assert by_name["alice"].rights == {GENERATE}
    assert by_name["ops"].rights == {GENERATE, ADMIN, ADMIN_READ}  # admin implies admin:read
    assert by_name["viewer"].rights == {ADMIN_READ}
    assert by_name["root"].may(GENERATE) and by_name["root"].may(ADMIN)
    # A digest line matches the token itself, never the digest text.
    assert tokens[hashlib.sha256(OPS.encode()).digest()].name == "ops"


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (f"alice generate {ALICE} extra", "tokens:1: expected NAME RIGHTS TOKEN, got 4 fields"),
        (f"alice {ALICE}", "tokens:1: expected NAME RIGHTS TOKEN, got 2 fields"),
        (f"alice generat {ALICE}", "tokens:1: unknown right 'generat'"),
        ("alice generate short", "tokens:1: the token of 'alice' is shorter than 16 characters"),
        ("alice generate sha256:abcd", "tokens:1: sha256: wants 64 hex digits"),
        (f"al/ice generate {ALICE}", "tokens:1: bad name 'al/ice'"),
    ],
)
def test_a_bad_tokens_line_is_named(line, error):
    with pytest.raises(ValueError) as info:
        parse_tokens(line, "tokens")
    assert str(info.value).startswith(error)


def test_duplicates_are_refused():
    with pytest.raises(ValueError, match="tokens:2: name 'a' appears twice"):
        parse_tokens(f"a generate {ALICE}\na admin {OPS}", "tokens")
    with pytest.raises(ValueError, match="tokens:2: the token of 'b' is also 'a''s"):
        parse_tokens(f"a generate {ALICE}\nb admin {ALICE}", "tokens")


def test_a_missing_tokens_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="--api-tokens-file: cannot read .*nope"):
        TokenFile(tmp_path / "nope")


def test_the_tokens_file_rotates_and_survives_a_bad_edit(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alice generate {ALICE}\n")
    tokens = TokenFile(path, check_interval_s=0)
    assert tokens.lookup(ALICE).name == "alice" and tokens.lookup(OPS) is None

    # Rotation as Kubernetes and careful operators do it: write aside, rename over.
    staged = tmp_path / "tokens.new"
    staged.write_text(f"ops generate,admin {OPS}\n")
    os.replace(staged, path)
    assert tokens.lookup(ALICE) is None and tokens.lookup(OPS).name == "ops"

    # A broken edit keeps the tokens last loaded, rather than locking everyone out.
    path.write_text("ops generate,admin\n")
    assert tokens.lookup(OPS).name == "ops"
    path.unlink()
    assert tokens.lookup(OPS).name == "ops"
    path.write_text(f"alice generate {ALICE}\n")
    assert tokens.lookup(ALICE).name == "alice" and tokens.lookup(OPS) is None


def test_the_tokens_file_is_checked_at_most_once_per_interval(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alice generate {ALICE}\n")
    tokens = TokenFile(path, check_interval_s=3600)
    path.write_text(f"ops generate,admin {OPS}\n")
    assert tokens.lookup(ALICE).name == "alice"  # not re-read within the interval


def test_a_tokens_file_others_can_read_is_flagged(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text(f"alice generate {ALICE}\n")
    path.chmod(0o600)
    TokenFile(path)
    assert "readable by others" not in caplog.text
    path.chmod(0o644)
    TokenFile(path)
    assert f"tokens file {path} is readable by others than its owner" in caplog.text


def test_which_right_each_method_needs():
    assert required_right("/grpc.health.v1.Health/Check") is OPEN
    assert required_right("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == ANY
    assert required_right("/pdserve.v1.Router/Generate") == GENERATE
    assert required_right("/pdserve.v1.Admin/ListNodes") == ADMIN_READ
    assert required_right("/pdserve.v1.Admin/Stats") == ADMIN_READ
    assert required_right("/pdserve.v1.Admin/Drain") == ADMIN
    assert required_right("/pdserve.v1.Admin/FlushCache") == ADMIN
    assert required_right("/pdserve.v1.Admin/SomethingNew") == ADMIN  # unforeseen: strictest


def test_the_interceptor_decision(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alice generate {ALICE}\nviewer admin:read {OPS}\n")
    auth = TokenAuthInterceptor([StaticToken("the-admin-token"), TokenFile(path)])
    gen, drain = "/pdserve.v1.Router/Generate", "/pdserve.v1.Admin/Drain"

    def bearer(token):
        return (("authorization", f"Bearer {token}"),)

    assert auth.check(gen, ())[0] is grpc.StatusCode.UNAUTHENTICATED
    assert auth.check(gen, bearer("nope-nope-nope-nope"))[0] is grpc.StatusCode.UNAUTHENTICATED
    assert auth.check(gen, bearer(ALICE)) is None
    code, message = auth.check(drain, bearer(ALICE))
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert message == "token 'alice' lacks the 'admin' right for /pdserve.v1.Admin/Drain"
    assert auth.check("/pdserve.v1.Admin/ListNodes", bearer(OPS)) is None
    assert auth.check(drain, bearer(OPS))[0] is grpc.StatusCode.PERMISSION_DENIED
    assert auth.check(drain, bearer("the-admin-token")) is None
    assert auth.check("/grpc.health.v1.Health/Check", ()) is None


def test_bearer_token_parsing():
    assert bearer_token((("authorization", "Bearer abc"),)) == "abc"
    assert bearer_token((("authorization", "bearer  abc "),)) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None
    assert bearer_token((("authorization", "Bearer "),)) is None
    assert bearer_token((("x-other", "Bearer abc"),)) is None


# ------------------------------------------------------------------------ TLS
def test_tls_flags_that_do_not_fit_are_one_line_errors(certs, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TLSConfig.from_paths(key=certs.key)
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TLSConfig.from_paths(cert=certs.cert)
    with pytest.raises(ValueError, match=r"--tls-client-ca \(mTLS\) needs the server's own"):
        TLSConfig.from_paths(client_ca=certs.ca)
    with pytest.raises(ValueError, match="--tls-ca: no such file: .*missing.pem"):
        TLSConfig.from_paths(ca=tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-cert: .*junk.pem is not a PEM file"):
        TLSConfig.from_paths(cert=junk, key=certs.key)


def test_tls_roles_and_the_flags_children_get(certs):
    plain = TLSConfig.from_paths()
    assert not plain.serves_tls and not plain.calls_tls
    assert plain.server_credentials() is None and plain.channel_credentials() is None
    full = TLSConfig.from_paths(
        cert=certs.cert, key=certs.key, ca=certs.ca, client_ca=certs.ca, server_name="localhost"
    )
    assert full.serves_tls and full.calls_tls
    assert full.server_credentials() is not None and full.channel_credentials() is not None
    assert full.channel_options() == [("grpc.ssl_target_name_override", "localhost")]
    assert "PRIVATE KEY" not in repr(full) and str(certs.key) in repr(full)
    # What `pdserve up` hands its children parses back into the same configuration.
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    assert TLSConfig.from_args(parser.parse_args(full.flags())) == full


# ---------------------------------------------------------------------- Redis
def test_redis_options():
    assert redis_options("redis://h:6379/0") == {}
    assert redis_options("redis://h:6379/0", password="pw", username="u") == {
        "password": "pw",
        "username": "u",
    }
    tls = redis_options("rediss://h:6380/0")
    assert tls["ssl_cert_reqs"] == "required" and tls["ssl_check_hostname"] is True


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(url="redis://:pw@h/0", password="pw"), "give the Redis password once"),
        (dict(url="redis://u:pw@h/0", username="u"), "give the Redis user once"),
        (dict(url="redis://h/0", username="u"), "--redis-username needs --redis-password"),
        (dict(url="redis://h/0", tls_ca="/ca.pem"), "--redis-tls-ca needs a rediss:// URL"),
        (dict(url="rediss://h/0", tls_ca="/no/ca.pem"), "--redis-tls-ca: no such file"),
        (dict(url="http://h/0"), "--redis-url: http scheme"),
    ],
)
def test_redis_options_that_clash(kwargs, error):
    with pytest.raises(ValueError, match=error):
        redis_options(**kwargs)


def test_passwords_stay_out_of_messages():
    assert redacted("redis://u:secret@h:6379/0") == "redis://u:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"
