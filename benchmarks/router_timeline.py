"""Where a request's first token spends its time through the router: a per-request timeline.

    python benchmarks/router_timeline.py --requests 500

The set-up of benchmarks/router_relay.py (Redis, a real `pdserve router`
process, a fake decode node answering at once), with stamps on one clock
(time.perf_counter, CLOCK_MONOTONIC, the same in every process of the host):
the client stamps each request's start and its first message; the router,
run by this script with its functions wrapped, stamps each stage of its path
(the routing read written, its reply, the policy, the Decode call, the first
message read and handed on); the fake node stamps its handler's start and its
first message. Sequential one-token requests alternate between the router and
the node's own Decode (the direct path, for scale). Printed: the p50 of each
segment. The wrappers cost a few microseconds each, so the total is a little
above router_relay.py's; the segments are what to compare.

A JSON record goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run
from benchmarks.fake_decode_node import NODE_ID, FakeWorker, fake_servicer, wait_routable
from pdserve.redis_server import RedisServer, free_port

STAMP = time.perf_counter


# ------------------------------------------------- inside the router process
def run_router(stamps_path: str, router_argv: list[str]) -> None:
    """`pdserve router` with its stages stamped; the stamps go to ``stamps_path`` at exit."""
    import router.frontend
    import router.routing
    import router.service as service
    from engine.block_hash import BlockHasher
    from engine.input_processor import InputProcessor
    from router.routing import Routing

    stamps: list[dict] = []
    current: dict[str, float] = {}

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        if asyncio.iscoroutinefunction(original):

            async def stamped(*a, **k):
                current.setdefault(label + "_start", STAMP())
                out = await original(*a, **k)
                current.setdefault(label, STAMP())
                return out
        else:

            def stamped(*a, **k):
                current.setdefault(label + "_start", STAMP())
                out = original(*a, **k)
                current.setdefault(label, STAMP())
                return out

        setattr(owner, name, stamped)

    generate = service.RouterServicer.generate

    async def stamped_generate(self, request, timeout_s):
        current.clear()
        current["enter"] = STAMP()
        first = True
        async for response in generate(self, request, timeout_s):
            if first:
                first = False
                current["yield"] = STAMP()
                stamps.append(dict(current))
            yield response

    service.RouterServicer.generate = stamped_generate
    wrap(router.frontend, "sampling_params_from_proto", "sampling")
    wrap(InputProcessor, "process", "checked")
    wrap(BlockHasher, "hash_blocks", "hashed")
    if hasattr(Routing, "start_view"):  # absent before the read went out early
        wrap(Routing, "start_view", "sent")
    wrap(Routing, "view", "read")
    wrap(router.routing, "choose_route", "policy")
    wrap(Routing, "route", "routed")
    node_messages = service.node_messages
    from router.node_session import NodeSession, SessionCall

    session_start = NodeSession.start

    async def stamped_start(self, *a, **k):
        current.setdefault("called", STAMP())  # the request leaves for the node: its start
        return await session_start(self, *a, **k)

    NodeSession.start = stamped_start
    session_read = SessionCall.read

    async def stamped_session_read(self):
        message = await session_read(self)
        current.setdefault("first_read", STAMP())
        return message

    SessionCall.read = stamped_session_read

    def stamped_messages(call, *a, **k):
        current.setdefault("called", STAMP())  # a Decode call made (--node-streams call)
        if not isinstance(call, SessionCall):
            read = call.read

            async def stamped_read():
                message = await read()
                current.setdefault("first_read", STAMP())
                return message

            call.read = stamped_read
        return node_messages(call, *a, **k)

    service.node_messages = stamped_messages
    atexit.register(lambda: Path(stamps_path).write_text(json.dumps(stamps)))
    from pdserve.cli import main

    sys.argv = ["pdserve", *router_argv]
    main()


# --------------------------------------------------------------- the fake node
async def fake_node(redis_url: str, port: int, model_id: str, stamps_path: str) -> None:
    """router_relay.py's fake decode node, stamping each request until SIGTERM."""
    import grpc

    from common.cluster.state import Cluster, NodeInfo, NodeRole
    from proto import internal_pb2_grpc

    stamps: list[tuple[str, float, float]] = []
    fake = FakeWorker()

    class Worker:  # router_relay's, stamped: where the node's handler starts and ends
        async def decode(self, request, deadline):
            start = STAMP()
            async for response in fake.decode(request, deadline):  # one token (max_tokens=1)
                stamps.append((request.request_id, start, STAMP()))
                yield response

    server = grpc.aio.server()
    internal_pb2_grpc.add_DecodeNodeServicer_to_server(fake_servicer(Worker()), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    cluster = Cluster.from_url(redis_url)
    info = NodeInfo(NODE_ID, NodeRole.DECODE, f"127.0.0.1:{port}", model_id, 16)
    info.kv_blocks_total = info.kv_blocks_free = 1 << 20
    info.max_num_seqs = 4096
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        await cluster.heartbeat(info)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    Path(stamps_path).write_text(json.dumps(stamps))


# ------------------------------------------------------------------ the client
async def client(args, router_address: str, node_address: str) -> list[tuple]:
    import grpc

    from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

    prompt = list(range(1, args.input_len + 1))
    sampling = pdserve_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    async with (
        grpc.aio.insecure_channel(router_address) as rc,
        grpc.aio.insecure_channel(node_address) as nc,
    ):
        router, node = pdserve_pb2_grpc.RouterStub(rc), internal_pb2_grpc.DecodeNodeStub(nc)
        for i in range(args.requests + args.warmup):
            request = pdserve_pb2.GenerateRequest(sampling=sampling)
            request.token_ids.ids.extend(prompt)
            start = STAMP()
            async for _ in router.Generate(request):
                routed = (start, STAMP())
                break
            direct = internal_pb2.DecodeRequest(
                request_id=f"direct-{i}", prompt_token_ids=prompt, sampling=sampling
            )
            start = STAMP()
            async for _ in node.Decode(direct):
                out.append((routed, (start, STAMP())))
                break
    return out[args.warmup :]


SEGMENTS = [
    # name, (process, from stamp), (process, to stamp)
    ("client -> router's handler", ("client", 0), ("router", "enter")),
    ("handler -> routing read written", ("router", "enter"), ("router", "sent")),
    ("  of which hashing", ("router", "hashed_start"), ("router", "hashed")),
    (
        "read written -> its reply awaited (the checks)",
        ("router", "sent"),
        ("router", "read_start"),
    ),
    ("  of which sampling parameters", ("router", "sampling_start"), ("router", "sampling")),
    ("  of which InputProcessor", ("router", "checked_start"), ("router", "checked")),
    ("waiting for the read's reply", ("router", "read_start"), ("router", "read")),
    ("policy", ("router", "policy_start"), ("router", "policy")),
    ("handler -> decision", ("router", "enter"), ("router", "routed")),
    ("decision -> request sent to the node", ("router", "routed"), ("router", "called")),
    ("sent -> node's handler", ("router", "called"), ("node", 1)),
    ("node's handler -> its first message", ("node", 1), ("node", 2)),
    ("node's first message -> router reads it", ("node", 2), ("router", "first_read")),
    ("router reads it -> hands it on", ("router", "first_read"), ("router", "yield")),
    ("router hands it on -> client", ("router", "yield"), ("client", 1)),
    ("total", ("client", 0), ("client", 1)),
]


def timeline(args, tmp: Path) -> dict:
    from engine.models.shapes import write_shape_dir

    model_dir = write_shape_dir("smollm2-135m", tmp / "model")
    node_stamps, router_stamps = tmp / "node.json", tmp / "router.json"
    node_port, port = free_port(), free_port()
    with RedisServer() as redis:
        me = [sys.executable, __file__]
        node = subprocess.Popen(
            [*me, "--fake-node", redis.url, str(node_port), model_dir.name, str(node_stamps)]
        )
        router_argv = ["router", "--model", str(model_dir), "--redis-url", redis.url]
        router_argv += ["--port", str(port), "--host", "127.0.0.1", "--admin-port"]
        router_argv += [str(free_port()), "--skip-tokenizer-init", "--no-access-log"]
        router_argv += ["--metrics-port", "0"]
        router = subprocess.Popen([*me, "--router", str(router_stamps), "--", *router_argv])
        try:
            wait_routable(f"127.0.0.1:{port}")
            pairs = asyncio.run(client(args, f"127.0.0.1:{port}", f"127.0.0.1:{node_port}"))
        finally:
            for proc in (node, router):
                proc.terminate()
            for proc in (node, router):
                proc.wait(timeout=20)
    routed_node = [s for s in json.loads(node_stamps.read_text()) if len(s[0]) == 32]
    direct_node = [s for s in json.loads(node_stamps.read_text()) if s[0].startswith("direct-")]
    n = args.requests
    rows = zip(pairs, json.loads(router_stamps.read_text())[-n:], routed_node[-n:], strict=True)
    samples: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    for (client_t, _), router_t, node_t in rows:
        where = {"client": dict(enumerate(client_t)), "router": router_t}
        where["node"] = dict(enumerate(node_t))
        for name, (p0, k0), (p1, k1) in SEGMENTS:
            if k0 in where[p0] and k1 in where[p1]:  # a stage the tree has
                samples[name].append(where[p1][k1] - where[p0][k0])
    direct = [(c[1][0], c[1][1], s) for c, s in zip(pairs, direct_node[-n:], strict=True)]
    out = {
        "direct": {
            "client -> node's handler": statistics.median(s[1] - c0 for c0, _, s in direct),
            "node's first message -> client": statistics.median(c1 - s[2] for _, c1, s in direct),
            "total": statistics.median(c1 - c0 for c0, c1, _ in direct),
        },
        "router": {k: statistics.median(v) for k, v in samples.items() if v},
    }
    out = {path: {k: v * 1e3 for k, v in d.items()} for path, d in out.items()}
    print(f"p50 over {n} one-token requests of {args.input_len} prompt tokens (ms):")
    for path, segments in out.items():
        print(path)
        for name, ms in segments.items():
            print(f"  {name:48s} {ms:7.3f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--fake-node", nargs=4, metavar=("REDIS", "PORT", "MODEL_ID", "STAMPS"))
    p.add_argument("--router", metavar="STAMPS", help="run the router, stamped (internal)")
    p.add_argument("router_argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.router:
        run_router(args.router, args.router_argv)
        return {}
    if args.fake_node:
        url, port, model_id, stamps = args.fake_node
        asyncio.run(fake_node(url, int(port), model_id, stamps))
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        results = timeline(args, Path(tmp))
    save_run("router_timeline", args, results, argv)
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
