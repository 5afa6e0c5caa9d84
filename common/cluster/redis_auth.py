"""Redis credentials and TLS: flags, connection options, and a start-up check.

``--redis-password`` (with ``--redis-username`` for an ACL user) authenticates;
a ``rediss://`` URL turns TLS on, verified against ``--redis-tls-ca`` (or the
system's CAs) with the host name checked. A component checks its credentials
once at start, so a wrong password is a one-line error there instead of a
stream of failed heartbeats or routing decisions.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def add_redis_auth_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = p.add_argument_group("Redis authentication and TLS (docs/security.md)")
    g.add_argument(
        "--redis-password",
        default=env("PDSERVE_REDIS_PASSWORD") or None,
        help="Redis password (requirepass, or the ACL user's) [PDSERVE_REDIS_PASSWORD]",
    )
    g.add_argument(
        "--redis-username",
        default=env("PDSERVE_REDIS_USERNAME") or None,
        help="Redis ACL user (with --redis-password) [PDSERVE_REDIS_USERNAME]",
    )
    g.add_argument(
        "--redis-tls-ca",
        default=env("PDSERVE_REDIS_TLS_CA") or None,
        help="CA bundle that verifies the Redis server (needs a rediss:// URL) "
        "[PDSERVE_REDIS_TLS_CA]",
    )


def redis_options(
    url: str,
    password: str | None = None,
    username: str | None = None,
    tls_ca: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.from_url(url, ...)``; ValueError when they clash."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--redis-url: {parts.scheme or 'no'} scheme; want redis:// or rediss://")
    # redis-py lets a password in the URL silently beat the flag: refuse the ambiguity.
    if password and parts.password:
        raise ValueError("give the Redis password once: in --redis-url or --redis-password")
    if username and parts.username:
        raise ValueError("give the Redis user once: in --redis-url or --redis-username")
    if username and not (password or parts.password):
        raise ValueError("--redis-username needs --redis-password")
    options: dict[str, Any] = {}
    if password:
        options["password"] = password
    if username:
        options["username"] = username
    if tls_ca:
        if parts.scheme != "rediss":
            raise ValueError("--redis-tls-ca needs a rediss:// URL (TLS)")
        if not Path(tls_ca).is_file():
            raise ValueError(f"--redis-tls-ca: no such file: {tls_ca}")
        options["ssl_ca_certs"] = str(tls_ca)
    if parts.scheme == "rediss":
        options["ssl_cert_reqs"] = "required"
        options["ssl_check_hostname"] = True
    return options


def redis_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return redis_options(
        args.redis_url,
        password=getattr(args, "redis_password", None),
        username=getattr(args, "redis_username", None),
        tls_ca=getattr(args, "redis_tls_ca", None),
    )


def redacted(url: str) -> str:
    """``url`` without a password, for logs and errors."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


async def check_redis(client: Any, url: str) -> None:
    """PING once. Credentials or a certificate that Redis refuses: ValueError (the
    configuration is wrong; retrying will not help). Unreachable: a warning only,
    since components ride out a Redis outage."""
    from redis import exceptions

    where = redacted(url)
    try:
        await client.ping()
    except exceptions.AuthenticationError as e:
        if not client.connection_pool.connection_kwargs.get("password"):
            raise ValueError(
                f"Redis at {where} wants a password: set --redis-password / "
                "PDSERVE_REDIS_PASSWORD (and --redis-username for an ACL user)"
            ) from None
        raise ValueError(
            f"Redis at {where} refused the credentials ({e}): check --redis-password / "
            "PDSERVE_REDIS_PASSWORD and --redis-username"
        ) from None
    except exceptions.ResponseError as e:
        # NOAUTH / WRONGPASS / an ACL user lacking a permission.
        if str(e).split(" ", 1)[0] in ("NOAUTH", "WRONGPASS", "NOPERM"):
            raise ValueError(f"Redis at {where} refused us: {e}") from None
        raise
    except exceptions.ConnectionError as e:
        if _is_tls_failure(e):
            raise ValueError(
                f"TLS with Redis at {where} failed ({_root(e)}): check --redis-tls-ca"
            ) from None
        logger.warning("Redis at %s is unreachable at start (%s); retrying as we go", where, e)


def _root(error: BaseException) -> BaseException:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def _is_tls_failure(error: BaseException) -> bool:
    return isinstance(_root(error), ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(error)
