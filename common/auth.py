"""Bearer tokens with rights: the tokens file, the admin token, and the gRPC interceptor.

The tokens file (``--api-tokens-file``, docs/security.md) has one token per line::

    # NAME    RIGHTS              TOKEN
    alice     generate            k7Qm1v0c9XrT2yLw8sPz
    ops       generate,admin      sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

NAME labels the token in logs and errors; RIGHTS is a comma-separated subset
of ``generate`` (the public API), ``admin:read`` (the admin API's read-only
calls), ``admin`` (every admin call) and ``*`` (everything); TOKEN is the
token itself (at least 16 characters) or ``sha256:`` and its digest in hex, so
the file need not hold the secret. The file is re-read when it changes, so
tokens rotate without a restart.

A call carries ``authorization: Bearer <token>``. No token or an unknown one:
UNAUTHENTICATED; a known token without the right the method needs:
PERMISSION_DENIED. Health checks are always open.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.grpc_server import refusing_handler

logger = logging.getLogger(__name__)

GENERATE, ADMIN_READ, ADMIN, ALL = "generate", "admin:read", "admin", "*"
RIGHTS = (GENERATE, ADMIN_READ, ADMIN, ALL)
IMPLIED = {ADMIN: {ADMIN_READ}, ALL: {GENERATE, ADMIN_READ, ADMIN}}
MIN_TOKEN_LENGTH = 16

OPEN = None  # no token needed
ANY = ""  # any valid token, whatever its rights

# The admin API's calls that change nothing.
ADMIN_READ_METHODS = {"ListNodes", "Stats", "ExplainRoute", "ListLoRAAdapters"}

_NAME = re.compile(r"^[A-Za-z0-9_.@:-]+$")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


def required_right(method: str) -> str | None:
    """The right a gRPC method (``/package.Service/Method``) needs; OPEN or ANY."""
    service, _, name = method.lstrip("/").partition("/")
    if service.startswith("grpc.health."):
        return OPEN  # probes (the launcher, Kubernetes) carry no token
    if service.startswith("grpc.reflection."):
        return ANY
    if service == "pdserve.v1.Router":
        return GENERATE
    if service == "pdserve.v1.Admin" and name in ADMIN_READ_METHODS:
        return ADMIN_READ
    return ADMIN  # the admin API's other calls, and anything unforeseen


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to, and what it may do."""

    name: str
    rights: frozenset[str]

    def may(self, right: str) -> bool:
        return right == ANY or right in self.rights


def _expand(rights: set[str]) -> frozenset[str]:
    out = set(rights)
    for r in rights:
        out |= IMPLIED.get(r, set())
    return frozenset(out)


def digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def parse_tokens(text: str, source: str) -> dict[bytes, Principal]:
    """Token digest -> Principal; ValueError naming the file and line of the first problem."""
    out: dict[bytes, Principal] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"{where}: expected NAME RIGHTS TOKEN, got {len(parts)} fields")
        name, rights_text, token = parts
        if not _NAME.match(name):
            raise ValueError(f"{where}: bad name {name!r} (letters, digits, _ . @ : -)")
        if name in names:
            raise ValueError(f"{where}: name {name!r} appears twice")
        rights = set(rights_text.split(","))
        unknown = sorted(rights - set(RIGHTS))
        if unknown:
            raise ValueError(f"{where}: unknown right {unknown[0]!r} (known: {', '.join(RIGHTS)})")
        m = _DIGEST.match(token)
        if m:
            key = bytes.fromhex(m.group(1))
        elif token.startswith("sha256:"):
            raise ValueError(f"{where}: sha256: wants 64 hex digits")
        elif len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"{where}: the token of {name!r} is shorter than {MIN_TOKEN_LENGTH} characters"
            )
        else:
            key = digest(token)
        if key in out:
            raise ValueError(f"{where}: the token of {name!r} is also {out[key].name!r}'s")
        names.add(name)
        out[key] = Principal(name, _expand(rights))
    return out


class TokenFile:
    """The tokens file, re-read when it changes (checked at most every ``check_interval_s``).

    A file that turns unreadable or invalid after start keeps the tokens last
    loaded (an error is logged once per change): a half-written rotation must
    not lock every client out. Replace the file atomically (write, rename).
    """

    def __init__(self, path: str | os.PathLike, check_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._stamp = None
        self._next_check = 0.0
        try:
            self._stamp = self._stat()
            self._tokens = parse_tokens(self.path.read_text(), str(self.path))
        except OSError as e:
            raise ValueError(f"--api-tokens-file: cannot read {self.path}: {e.strerror}") from None
        self._next_check = time.monotonic() + check_interval_s
        logger.info("%d API tokens loaded from %s", len(self._tokens), self.path)
        if os.stat(self.path).st_mode & 0o077:
            logger.warning(
                "tokens file %s is readable by others than its owner (chmod 600, or store "
                "sha256: digests)",
                self.path,
            )

    def _stat(self):
        s = os.stat(self.path)
        return (s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.check_interval_s
        try:
            stamp = self._stat()
        except OSError as e:
            if self._stamp is not None:
                logger.error("tokens file %s: %s; keeping the tokens loaded", self.path, e)
                self._stamp = None
            return
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            tokens = parse_tokens(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as e:
            logger.error("tokens file not reloaded, keeping the tokens loaded: %s", e)
            return
        self._tokens = tokens
        logger.info("tokens file %s changed: %d API tokens loaded", self.path, len(tokens))

    def lookup(self, token: str) -> Principal | None:
        self._refresh()
        return self._tokens.get(digest(token))

    def __len__(self) -> int:
        return len(self._tokens)


class StaticToken:
    """One token given on the command line (``--admin-token``): every admin right."""

    def __init__(self, token: str, name: str = "admin-token", rights=(ADMIN,)) -> None:
        if not token:
            raise ValueError("the token must not be empty")
        self._expected = token.encode()
        self._principal = Principal(name, _expand(set(rights)))

    def lookup(self, token: str) -> Principal | None:
        # Constant time: a wrong token's timing says nothing about the right one.
        return self._principal if hmac.compare_digest(token.encode(), self._expected) else None


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks needs a bearer token from one of ``sources``
    (objects with ``lookup(token) -> Principal | None``) with the method's right."""

    def __init__(self, sources: list) -> None:
        if not sources:
            raise ValueError("token authentication needs at least one token source")
        self.sources = sources

    def check(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else the status and message to refuse it with."""
        right = required_right(method)
        if right is OPEN:
            return None
        token = bearer_token(metadata)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing token (authorization: Bearer <token>)"
        principal = next((p for s in self.sources if (p := s.lookup(token)) is not None), None)
        if principal is None:
            return grpc.StatusCode.UNAUTHENTICATED, "unknown token"
        if not principal.may(right):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"token {principal.name!r} lacks the {right!r} right for {method}",
            )
        return None

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        refusal = self.check(details.method, details.invocation_metadata)
        if refusal is None:
            return handler
        return refusing_handler(handler, *refusal)


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--api-tokens-file",
        default=env("PDSERVE_API_TOKENS_FILE") or None,
        help="bearer tokens with rights (docs/security.md); re-read when it changes. "
        "Without it the public API takes calls without a token [PDSERVE_API_TOKENS_FILE]",
    )


def router_interceptors(tokens_file: str | None, admin_token: str | None) -> tuple[list, list]:
    """(public server interceptors, admin server interceptors); empty: no token checks.

    The admin API takes the ``--admin-token`` and file tokens with an admin
    right; the public API takes file tokens with ``generate``.
    """
    tokens = TokenFile(tokens_file) if tokens_file else None
    public = [TokenAuthInterceptor([tokens])] if tokens else []
    admin_sources = [s for s in (StaticToken(admin_token) if admin_token else None, tokens) if s]
    admin = [TokenAuthInterceptor(admin_sources)] if admin_sources else []
    return public, admin
