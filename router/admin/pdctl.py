"""`pdctl`: the admin command line (talks to the router's Admin service).

    pdctl nodes                      the cluster's nodes, their load and cache
    pdctl drain NODE [--wait]        no new requests for NODE (--wait: until idle)
    pdctl undrain NODE               take requests again
    pdctl stats [--watch [SECONDS]]  latency percentiles, prefix hits, placement
    pdctl explain PROMPT             where PROMPT would go now, and why
    pdctl flush NODE                 evict NODE's unused cached KV blocks
    pdctl top [--interval S] [--once] live view of nodes and router latency (q quits)
    pdctl lora list|load NAME PATH|unload NAME   LoRA adapters on every node

Options (or environment): --address HOST:PORT [PDCTL_ADDRESS, default
127.0.0.1:50052], --token TOKEN [PDCTL_TOKEN], --timeout SECONDS, --json
(machine-readable output, before or after the command); TLS: --tls-ca FILE
[PDCTL_TLS_CA], --tls-cert/--tls-key FILE (mTLS) [PDCTL_TLS_CERT,
PDCTL_TLS_KEY], --tls (the system's CAs), --tls-server-name NAME.
Exit codes: 0 ok, 1 the router answered with an error, 2 bad usage,
3 the router is unreachable, 4 the token is missing or wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time

import grpc

from common.tls import TLSConfig, add_client_tls_arguments, make_sync_channel
from proto import admin_pb2, admin_pb2_grpc, pdserve_pb2

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH = 1, 2, 3, 4
NODE_COLUMNS = [
    ("NODE", "node_id"),
    ("ROLE", "role"),
    ("ADDRESS", "address"),
    ("FAMILY", "model_family"),
    ("TP", "tensor_parallel_size"),
    ("GPUS", "num_gpus"),
    ("WEIGHTS", "weight_dtype"),
    ("KV DTYPE", "kv_cache_dtype"),
    ("KV FREE", "kv_blocks_free"),
    ("KV TOTAL", "kv_blocks_total"),
    ("HOST FREE", "host_kv_blocks_free"),  # the host tier (--swap-space); 0 and 0: none
    ("HOST TOTAL", "host_kv_blocks_total"),
    ("RUNNING", "running"),
    ("WAITING", "waiting"),
    ("QUEUED PREFILL", "queued_prefill_tokens"),
    ("CACHED BLOCKS", "cached_blocks"),
    ("HOST CACHED", "host_cached_blocks"),
    ("DRAINING", "draining"),
    ("HEARTBEAT", "heartbeat_age_ms"),
]


def as_dict(message) -> dict:
    """Every field with the proto's names; 64-bit integers stay JSON numbers
    (the canonical proto JSON mapping would make them strings), unset optional
    fields are null."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.is_repeated:
            out[f.name] = [as_dict(v) if f.message_type else v for v in value]
        elif f.message_type is not None:
            out[f.name] = as_dict(value)
        elif f.has_presence and not message.HasField(f.name):
            out[f.name] = None
        else:
            out[f.name] = value
    return out


def node_dict(n: admin_pb2.NodeInfo) -> dict:
    return {field: getattr(n, field) for _, field in NODE_COLUMNS}


def cell(value) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers, *[[cell(v) for v in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def emit(args, data, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text, flush=True)


# ------------------------------------------------------------------- commands
def cmd_nodes(stub, args) -> int:
    nodes = stub.ListNodes(admin_pb2.ListNodesRequest(), **args.call).nodes
    rows = [node_dict(n) for n in nodes]
    text = table(
        [h for h, _ in NODE_COLUMNS],
        [
            [f"{r[f]} ms" if f == "heartbeat_age_ms" else r[f] for _, f in NODE_COLUMNS]
            for r in rows
        ],
    )
    emit(args, rows, text)
    return 0


def cmd_drain(stub, args) -> int:
    node = stub.Drain(admin_pb2.DrainRequest(node_id=args.node), **args.call).node
    if not args.json:
        print(f"{node.node_id}: draining ({node.running + node.waiting} requests in flight)")
    if args.wait:
        node = wait_idle(stub, args)
        if node is None:
            print(
                f"pdctl: error: {args.node} still busy after {args.wait_timeout:.0f} s",
                file=sys.stderr,
            )
            return EXIT_ERROR
    if args.json:
        emit(args, node_dict(node), "")
    elif args.wait:
        print(f"{node.node_id}: drained, idle")
    return 0


def wait_idle(stub, args) -> admin_pb2.NodeInfo | None:
    """Poll until the node runs nothing (progress on stderr); None on timeout."""
    deadline = time.monotonic() + args.wait_timeout
    while True:
        nodes = {
            n.node_id: n for n in stub.ListNodes(admin_pb2.ListNodesRequest(), **args.call).nodes
        }
        node = nodes.get(args.node)
        if node is None:  # gone (stopped): nothing runs there
            return admin_pb2.NodeInfo(node_id=args.node, draining=True)
        busy = node.running + node.waiting
        if busy == 0:
            return node
        if time.monotonic() > deadline:
            return None
        print(f"  {node.node_id}: {busy} requests in flight", file=sys.stderr, flush=True)
        time.sleep(1.0)


def cmd_undrain(stub, args) -> int:
    node = stub.Undrain(admin_pb2.DrainRequest(node_id=args.node), **args.call).node
    emit(args, node_dict(node), f"{node.node_id}: taking requests")
    return 0


def stats_text(s: admin_pb2.StatsResponse) -> str:
    lat = table(
        ["LATENCY (ms)", "COUNT", "MEAN", "P50", "P90", "P99"],
        [
            [name, x.count, x.mean_ms, x.p50_ms, x.p90_ms, x.p99_ms]
            if x.count
            else [name, 0, "-", "-", "-", "-"]
            for name, x in (("ttft", s.ttft), ("tpot", s.tpot), ("itl", s.itl), ("e2e", s.e2e))
        ],
    )
    per_node = table(
        ["NODE", "ROLE", "REQUESTS"],
        [[n.node_id, "decode", n.count] for n in s.requests_per_decode_node]
        + [[n.node_id, "prefill", n.count] for n in s.requests_per_prefill_node],
    )
    statuses = ", ".join(f"{c.status} {c.count}" for c in s.requests_by_status) or "none"
    return "\n".join(
        [
            lat,
            "",
            f"prefix-cache hits: {s.prefix_hit_rate:.1%} "
            f"({s.cached_tokens} of {s.prompt_tokens} prompt tokens)",
            f"requests: {statuses}; in flight {s.in_flight}; "
            f"prefilled on the decode node {s.local_prefills}",
            f"preemptions: {s.preemptions}",
            f"KV transfers: {s.kv_transfers} ({s.kv_transfer_bytes / 2**20:.1f} MiB, "
            f"{s.kv_transfer_gbps:.2f} GB/s while sending), failed {s.kv_transfer_failures}",
            spec_decode_line(s),
            f"router up {s.uptime_s:.0f} s",
            "",
            per_node,
        ]
    )


def spec_decode_line(s: admin_pb2.StatsResponse) -> str:
    """Speculative decoding's acceptance: the share of proposed tokens kept, and
    tokens emitted per verify step of a sequence (kept ones + the target's own)."""
    if not s.spec_draft_tokens:
        return "speculative decoding: no proposals"
    rate = s.spec_accepted_tokens / s.spec_draft_tokens
    mean_len = 1 + s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else 0.0
    return (
        f"speculative decoding: {s.spec_accepted_tokens} of {s.spec_draft_tokens} proposed "
        f"tokens accepted ({rate:.1%}), mean acceptance length {mean_len:.2f}"
    )


def cmd_stats(stub, args) -> int:
    stop = threading.Event()
    if args.watch is not None:
        # Ctrl-C / SIGTERM end the watch after the current call, never inside
        # gRPC's blocking machinery (where an interrupt can wedge the channel).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    while True:
        s = stub.Stats(admin_pb2.StatsRequest(), **args.call)
        emit(args, as_dict(s), stats_text(s))
        if args.watch is None or stop.wait(args.watch):
            return 0
        if not args.json:
            print(flush=True)


def cmd_explain(stub, args) -> int:
    request = pdserve_pb2.GenerateRequest(cache_salt=args.cache_salt or "", model=args.model)
    if args.token_ids:
        try:
            request.token_ids.ids.extend(int(t) for t in args.prompt.replace(",", " ").split())
        except ValueError:
            print("pdctl: error: --token-ids wants integers", file=sys.stderr)
            return EXIT_USAGE
    elif args.chat:
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    r = stub.ExplainRoute(admin_pb2.ExplainRouteRequest(request=request), **args.call)
    where = (
        f"decode on {r.decode_node}, prefill on {r.prefill_node}"
        if r.prefill_node
        else f"decode and prefill on {r.decode_node} ({r.local_prefill_reason})"
    )
    rows = [
        [
            n.node_id,
            n.role,
            n.hit_blocks,
            n.host_hit_blocks,
            n.cost if n.HasField("cost") else "-",
            " ".join(f"{k}={v:.3g}" for k, v in sorted(n.terms.items())) or "-",
            n.excluded or "-",
        ]
        for n in r.nodes
    ]
    text = "\n".join(
        [
            f"policy {r.policy}; {r.prompt_tokens} prompt tokens, {len(r.block_hashes)} full blocks",
            f"route: {where}",
            "",
            table(["NODE", "ROLE", "HIT BLOCKS", "HOST HIT", "COST", "TERMS", "EXCLUDED"], rows),
        ]
    )
    emit(args, as_dict(r), text)
    return 0


def cmd_flush(stub, args) -> int:
    r = stub.FlushCache(admin_pb2.FlushCacheRequest(node_id=args.node), **args.call)
    emit(
        args,
        {"node_id": args.node, "blocks_flushed": r.blocks_flushed},
        f"{args.node}: {r.blocks_flushed} cached blocks evicted",
    )
    return 0


# ---------------------------------------------------------------- lora
# A load reads and checks the adapter's files on every node: more than a call's default.
LOAD_TIMEOUT_S = 120.0


def adapter_dict(a: admin_pb2.LoRAAdapter) -> dict:
    return {
        "name": a.name,
        "digest": a.digest,
        "node_ids": list(a.node_ids),
        "resident_node_ids": list(a.resident_node_ids),
    }


def cmd_lora_list(stub, args) -> int:
    adapters = stub.ListLoRAAdapters(admin_pb2.ListLoRAAdaptersRequest(), **args.call).adapters
    rows = [adapter_dict(a) for a in adapters]
    text = table(
        ["NAME", "DIGEST", "NODES", "IN A DEVICE SLOT"],
        [
            [r["name"], r["digest"], ",".join(r["node_ids"]), ",".join(r["resident_node_ids"])]
            for r in rows
        ],
    )
    emit(args, rows, text if rows else "no LoRA adapters loaded")
    return 0


def cmd_lora_load(stub, args) -> int:
    call = {**args.call, "timeout": max(args.call["timeout"], LOAD_TIMEOUT_S)}
    request = admin_pb2.LoadLoRAAdapterRequest(lora_name=args.name, lora_path=args.path)
    a = stub.LoadLoRAAdapter(request, **call).adapter
    emit(
        args,
        adapter_dict(a),
        f"LoRA adapter {a.name!r} loaded on {', '.join(a.node_ids)} (digest {a.digest})",
    )
    return 0


def cmd_lora_unload(stub, args) -> int:
    request = admin_pb2.UnloadLoRAAdapterRequest(lora_name=args.name)
    r = stub.UnloadLoRAAdapter(request, **args.call)
    emit(
        args,
        {**adapter_dict(r.adapter), "requests_in_flight": r.requests_in_flight},
        f"LoRA adapter {r.adapter.name!r} unloaded from {', '.join(r.adapter.node_ids)}; "
        f"{r.requests_in_flight} requests in flight finish on it",
    )
    return 0


def add_lora_parser(sub, parents) -> None:
    lora = sub.add_parser("lora", parents=parents, help="LoRA adapters: list, load, unload")
    commands = lora.add_subparsers(dest="lora_command", required=True)
    commands.add_parser(
        "list", parents=parents, help="adapters and the nodes holding them"
    ).set_defaults(func=cmd_lora_list)
    load = commands.add_parser("load", parents=parents, help="load NAME from PATH on every node")
    load.add_argument("name", help="the adapter's name (requests name it as their model)")
    load.add_argument("path", help="a PEFT adapter directory, the same on every node")
    load.set_defaults(func=cmd_lora_load)
    unload = commands.add_parser("unload", parents=parents, help="unload NAME from every node")
    unload.add_argument("name")
    unload.set_defaults(func=cmd_lora_unload)


# --------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="pdctl", description=__doc__.split("\n")[0])
    p.add_argument(
        "--address",
        default=env("PDCTL_ADDRESS", "127.0.0.1:50052"),
        help="the router's admin API [PDCTL_ADDRESS]",
    )
    p.add_argument("--token", default=env("PDCTL_TOKEN"), help="admin token [PDCTL_TOKEN]")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_client_tls_arguments(p, "PDCTL")
    # --json after the command too (SUPPRESS: it does not reset the global one).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="as pdctl --json"
    )
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("nodes", parents=[common], help="list the nodes").set_defaults(func=cmd_nodes)
    d = sub.add_parser("drain", parents=[common], help="send NODE no new requests")
    d.add_argument("node")
    d.add_argument("--wait", action="store_true", help="return once NODE runs nothing")
    d.add_argument("--wait-timeout", type=float, default=600.0, help="seconds")
    d.set_defaults(func=cmd_drain)
    u = sub.add_parser("undrain", parents=[common], help="send NODE requests again")
    u.add_argument("node")
    u.set_defaults(func=cmd_undrain)
    s = sub.add_parser("stats", parents=[common], help="latency, prefix hits, placement")
    s.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="repeat every SECONDS (default 2) until Ctrl-C",
    )
    s.set_defaults(func=cmd_stats)
    e = sub.add_parser("explain", parents=[common], help="where a prompt would go, and why")
    e.add_argument("prompt")
    e.add_argument("--chat", action="store_true", help="as a user chat message")
    e.add_argument("--token-ids", action="store_true", help="PROMPT is token ids")
    e.add_argument("--cache-salt", default=None)
    e.add_argument("--model", default="", help="a LoRA adapter's name (default: the base model)")
    e.set_defaults(func=cmd_explain)
    f = sub.add_parser("flush", parents=[common], help="evict NODE's unused cached blocks")
    f.add_argument("node")
    f.set_defaults(func=cmd_flush)
    from router.admin.top import add_top_parser  # rich loads only with the parser

    add_top_parser(sub, [common])
    add_lora_parser(sub, [common])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else 0
    args.call = {"timeout": args.timeout}
    if args.token:
        args.call["metadata"] = (("authorization", f"Bearer {args.token}"),)
    try:
        tls = TLSConfig.from_args(args)
    except ValueError as e:
        print(f"pdctl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    with make_sync_channel(args.address, tls) as channel:
        try:
            # Connect first, so that "unreachable" never mixes with the router's answers.
            grpc.channel_ready_future(channel).result(timeout=min(args.timeout, 5.0))
        except grpc.FutureTimeoutError:
            hint = "" if tls.calls_tls else " (if it wants TLS: --tls-ca)"
            print(
                f"pdctl: error: the router at {args.address} is unreachable{hint}",
                file=sys.stderr,
            )
            return EXIT_UNREACHABLE
        try:
            return args.func(admin_pb2_grpc.AdminStub(channel), args)
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:
            return closed_stdout()
        except grpc.RpcError as e:
            return report(e, args)


def closed_stdout() -> int:
    """The reader left (`pdctl stats --json | head`): exit quietly. Python's
    own flush of stdout at exit would fail again, so stdout goes to /dev/null."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def report(e: grpc.RpcError, args) -> int:
    code, details = e.code(), e.details() or ""
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        hint = "" if args.token else " (set --token or PDCTL_TOKEN)"
        print(f"pdctl: error: the router refused the token: {details}{hint}", file=sys.stderr)
        return EXIT_AUTH
    print(f"pdctl: error: {code.name}: {details}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
