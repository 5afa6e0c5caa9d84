"""`pdctl`: the admin command line (talks to the router's Admin service).

    pdctl nodes [--json]        the cluster's nodes, their load and cache

Options (or environment): --address HOST:PORT [PDCTL_ADDRESS, default 127.0.0.1:50052],
--timeout SECONDS. Exit codes: 0 ok, 1 the router answered with an error,
2 bad usage, 3 the router is unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from proto import admin_pb2, admin_pb2_grpc

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
COLUMNS = [
    ("NODE", "node_id"),
    ("ROLE", "role"),
    ("ADDRESS", "address"),
    ("KV FREE", "kv_blocks_free"),
    ("KV TOTAL", "kv_blocks_total"),
    ("RUNNING", "running"),
    ("WAITING", "waiting"),
    ("QUEUED PREFILL", "queued_prefill_tokens"),
    ("CACHED BLOCKS", "cached_blocks"),
    ("DRAINING", "draining"),
    ("HEARTBEAT", "heartbeat_age_ms"),
]


def node_dict(n: admin_pb2.NodeInfo) -> dict:
    return {field: getattr(n, field) for _, field in COLUMNS}


def table(rows: list[dict]) -> str:
    cells = [[h for h, _ in COLUMNS]]
    for r in rows:
        cells.append(
            [
                f"{r[f]} ms"
                if f == "heartbeat_age_ms"
                else ("yes" if r[f] is True else "no" if r[f] is False else str(r[f]))
                for _, f in COLUMNS
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def cmd_nodes(stub: admin_pb2_grpc.AdminStub, args: argparse.Namespace) -> int:
    nodes = [
        node_dict(n)
        for n in stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=args.timeout).nodes
    ]
    print(json.dumps(nodes, indent=2) if args.json else table(nodes))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdctl", description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("PDCTL_ADDRESS", "127.0.0.1:50052"))
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes", help="list the nodes").set_defaults(func=cmd_nodes)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else 0
    with grpc.insecure_channel(args.address) as channel:
        try:
            return args.func(admin_pb2_grpc.AdminStub(channel), args)
        except grpc.RpcError as e:
            if e.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) and "cluster" not in (e.details() or ""):
                print(
                    f"pdctl: error: the router at {args.address} is unreachable ({e.code().name})",
                    file=sys.stderr,
                )
                return EXIT_UNREACHABLE
            print(f"pdctl: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
