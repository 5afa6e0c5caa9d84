"""TLS and mTLS for every gRPC hop: credentials from flags or environment.

One ``TLSConfig`` per process serves both directions:

- as a server (``add_port``): ``--tls-cert``/``--tls-key`` turn TLS on;
  ``--tls-client-ca`` also requires and verifies client certificates (mTLS);
- as a client (``make_channel``): ``--tls-ca`` turns TLS on for outgoing calls
  and verifies the server against it; when the process has a certificate of
  its own, it presents it, so a peer that requires client certificates
  accepts the call.

Files are read once, at start: a certificate rotation is a rolling restart.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# (flag, environment variable, help); the names are shared with the deploy manifests.
TLS_FLAGS = (
    ("--tls-cert", "PDSERVE_TLS_CERT", "this process's certificate chain (PEM): TLS on its servers"),
    ("--tls-key", "PDSERVE_TLS_KEY", "the private key of --tls-cert (PEM)"),
    ("--tls-ca", "PDSERVE_TLS_CA", "CA bundle that verifies servers this process calls: TLS on outgoing calls"),
    ("--tls-client-ca", "PDSERVE_TLS_CLIENT_CA", "CA bundle that verifies client certificates; required (mTLS)"),
    ("--tls-server-name", "PDSERVE_TLS_SERVER_NAME", "name expected in the certificates of servers this process calls (default: the host of their address)"),
)  # fmt: skip


@dataclass(frozen=True)
class TLSConfig:
    """PEM bytes (read at construction) and the paths they came from. The repr
    shows the paths only: a private key must never reach a log or a traceback."""

    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    client_ca: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    system_roots: bool = False  # clients only: TLS verified against the system's CAs
    paths: tuple[tuple[str, str], ...] = ()  # (flag, path), to hand the same files to children

    @classmethod
    def from_paths(
        cls,
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        ca: str | os.PathLike | None = None,
        client_ca: str | os.PathLike | None = None,
        server_name: str | None = None,
        system_roots: bool = False,
    ) -> TLSConfig:
        """Read and check the files; ValueError (one line, naming the flag) when they do not fit."""
        if bool(cert) != bool(key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if client_ca and not cert:
            raise ValueError(
                "--tls-client-ca (mTLS) needs the server's own --tls-cert and --tls-key"
            )
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca, "--tls-client-ca": client_ca}
        data = {flag: _read_pem(flag, path) for flag, path in given.items() if path}
        return cls(
            cert=data.get("--tls-cert"),
            key=data.get("--tls-key"),
            ca=data.get("--tls-ca"),
            client_ca=data.get("--tls-client-ca"),
            server_name=server_name or None,
            system_roots=system_roots,
            paths=tuple((flag, str(path)) for flag, path in given.items() if path),
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TLSConfig:
        return cls.from_paths(
            cert=getattr(args, "tls_cert", None),
            key=getattr(args, "tls_key", None),
            ca=getattr(args, "tls_ca", None),
            client_ca=getattr(args, "tls_client_ca", None),
            server_name=getattr(args, "tls_server_name", None),
            system_roots=getattr(args, "tls", False),
        )

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    @property
    def calls_tls(self) -> bool:
        return self.ca is not None or self.system_roots

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.serves_tls:
            return None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.calls_tls:
            return None
        # Our own certificate doubles as the client certificate: peers with mTLS want one.
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.calls_tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def flags(self) -> list[str]:
        """The command-line flags that give a child process the same files."""
        out = [x for flag, path in self.paths for x in (flag, path)]
        if self.server_name:
            out += ["--tls-server-name", self.server_name]
        return out


NO_TLS = TLSConfig()


def _read_pem(flag: str, path: str | os.PathLike) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such file: {p}") from None
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {p}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {p} is not a PEM file")
    return data


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The TLS flags of a component (router, prefill and decode nodes)."""
    g = p.add_argument_group("TLS (docs/security.md)")
    for flag, env_name, text in TLS_FLAGS:
        g.add_argument(flag, default=os.environ.get(env_name) or None, help=f"{text} [{env_name}]")


def add_client_tls_arguments(p: argparse.ArgumentParser, env_prefix: str) -> None:
    """TLS flags of a command-line client (pdctl, `pdserve generate`)."""
    env = os.environ.get
    p.add_argument(
        "--tls",
        action="store_true",
        default=env(f"{env_prefix}_TLS") == "1",
        help=f"TLS, verifying the server against the system's CAs [{env_prefix}_TLS=1]",
    )
    for flag, text in (
        ("--tls-ca", "CA bundle that verifies the server: TLS on"),
        ("--tls-cert", "client certificate (PEM), for a server that requires one (mTLS)"),
        ("--tls-key", "the private key of --tls-cert"),
        ("--tls-server-name", "name expected in the server's certificate"),
    ):
        env_name = f"{env_prefix}_{flag[2:].upper().replace('-', '_')}"
        p.add_argument(flag, default=env(env_name) or None, help=f"{text} [{env_name}]")


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig = NO_TLS) -> int:
    """Listen on ``address``, with TLS when the process has a certificate."""
    credentials = tls.server_credentials()
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def make_channel(
    address: str, tls: TLSConfig = NO_TLS, options: list | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to ``address``, with TLS when the process has a CA to verify servers."""
    options = [*(options or []), *tls.channel_options()]
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def make_sync_channel(
    address: str, tls: TLSConfig = NO_TLS, options: list | None = None
) -> grpc.Channel:
    """The blocking twin of ``make_channel`` (health probes, command-line tools)."""
    options = [*(options or []), *tls.channel_options()]
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)
