"""The cluster's wire contract version: the session messages (proto/internal.proto)
and the KV stream's format (common/kv_transfer/protocol.py) together.

Every session is opened with the client's version in the call's metadata
(``VERSION_KEY``); a server of another version refuses the call with
FAILED_PRECONDITION, and the server's first batch names its own version, which
the client checks the same way. Nodes and routers of different versions
therefore never exchange a request: the error names both versions, so an
operator sees at once which side of a rolling update to finish. Any change to
what travels between pdserve processes bumps it.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
VERSION_KEY = "pdserve-protocol-version"


class VersionMismatch(RuntimeError):
    """The other end speaks another protocol version."""


def mismatch(ours: int, theirs: int | None, peer: str) -> str | None:
    """Why ``peer`` (speaking ``theirs``; None: it said nothing) cannot talk to
    this process, or None when it can."""
    if theirs == ours:
        return None
    said = "no protocol version" if theirs is None else f"protocol version {theirs}"
    return (
        f"{peer} speaks {said}, this process {ours}: run one pdserve release across "
        "the cluster (routers and nodes)"
    )


def version_of(metadata) -> int | None:
    """The protocol version in a call's invocation metadata (None: absent or not a number)."""
    for key, value in metadata or ():
        if key == VERSION_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None
