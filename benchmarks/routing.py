"""Routing: prefix-cache hits and TTFT of three policies on one multi-turn
workload, and the cost of one routing decision.

    python benchmarks/routing.py                     # both parts (demo model, CPU is fine)
    python benchmarks/routing.py --part decision     # decision latency only (Redis, no model)
    python benchmarks/routing.py --part workload --users 32 --turns 6
    python benchmarks/routing.py --shape smollm2-135m --device cpu   # no model files needed

Workload part. Starts Redis, ``--prefill`` prefill and ``--decode`` decode
nodes (`pdserve up`'s launcher) and one router per policy (random,
round-robin, cost), all on the same nodes. For each policy in turn: every
node's prefix cache is flushed (Admin.FlushCache), then the same synthetic chat
traffic runs through that policy's router: ``--users`` conversations, each on
one of ``--systems`` shared system prompts, ``--turns`` turns each, where turn
t's prompt is turn t-1's prompt + the generated reply + a new user message
(token ids, so nothing depends on a chat template), ``--concurrency``
conversations at a time. Reported per policy: prefix-cache hit rate (cached /
prompt tokens, from each request's usage), the best possible hit rate on the
same requests, TTFT percentiles, and placement.

"Best possible" is a bound no placement can beat: a request can at most reuse
the longest block-aligned prefix it shares with the prompt or reply of any
other request sent before its own first token came back (one infinite cache
holding everything), less the last prompt token, which is always computed.

Decision part. A real redis-server holding 16 synthetic nodes (8 prefill,
8 decode), each with ``--other-blocks`` unrelated cached blocks and a different
leading part of the test prompt. One decision for an 8k-token prompt = hashing
its blocks + the routing read (one Redis round trip, counted on the wire) + the
router's in-flight split + the policy. Baseline in the same run: the previous
routing read (HGETALL of every node + SMISMEMBER of every block).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run, summary_ms
from benchmarks.routing_decision import decision_latency
from pdserve.bench.datasets import MultiTurnSpec, MultiTurnWorkload

POLICIES = ("random", "round-robin", "cost")


# ---------------------------------------------------------------- workload
@dataclass(slots=True)
class Turn:
    user: int
    turn: int
    prompt: list[int]
    sent: float = 0.0
    done: float = 0.0
    output: list[int] = field(default_factory=list)
    cached: int = 0
    ttft_ms: float = float("nan")
    prefill_node: str = ""
    decode_node: str = ""


def make_workload(args: argparse.Namespace, vocab: int) -> MultiTurnWorkload:
    """The conversations (one implementation: `pdserve bench serve --dataset multi-turn`'s)."""
    spec = MultiTurnSpec(
        users=args.users,
        turns=args.turns,
        systems=args.systems,
        system_tokens=args.system_tokens,
        min_user_tokens=args.min_user_tokens,
        max_user_tokens=args.max_user_tokens,
        output_tokens=args.output_tokens,
    )
    return MultiTurnWorkload.make(spec, vocab, args.seed)


def run_conversation(
    address: str, w: MultiTurnWorkload, user: int, args, turns: list[Turn], progress=None
) -> None:
    from proto.client import generate

    req = w.first_turn(user)
    while req is not None:
        rec = Turn(user, req.turn, list(req.prompt))
        rec.sent = time.monotonic()
        for r in generate(
            address,
            token_ids=rec.prompt,
            max_tokens=req.output_len,
            temperature=0.0,
            ignore_eos=True,
            timeout=600,
        ):
            for d in r.deltas:
                if d.token_ids and not rec.output:
                    rec.ttft_ms = (time.monotonic() - rec.sent) * 1e3
                rec.output.extend(d.token_ids)
            if r.HasField("final"):
                usage = r.final.usage
                rec.cached = usage.cached_tokens
                rec.prefill_node = usage.prefill_node
                rec.decode_node = usage.decode_node
        rec.done = time.monotonic()
        turns.append(rec)
        if progress is not None:
            progress()
        req = w.next_turn(req, rec.output)


def best_possible(turns: list[Turn], block_size: int) -> list[int]:
    """Per request: the most prompt tokens any placement could have served from cache.

    A request can only reuse blocks that some other request computed before
    its own prefill ran, and such a request was sent before this one's first
    token came back. So the bound credits a request with the blocks (prompt
    and reply) of every other request sent before its first token: one
    infinite cache holding everything, generous to the baseline (two requests
    sent together are both credited with each other's blocks).
    """
    from engine.block_hash import BlockHasher

    hasher = BlockHasher("bound", block_size)
    full = [hasher.hash_blocks(t.prompt + t.output) for t in turns]
    by_sent = sorted(range(len(turns)), key=lambda i: turns[i].sent)
    seen: Counter[bytes] = Counter()
    bounds = [0] * len(turns)
    j = 0
    for i in sorted(range(len(turns)), key=lambda i: turns[i].sent + turns[i].ttft_ms / 1e3):
        t = turns[i]
        while j < len(by_sent) and turns[by_sent[j]].sent < t.sent + t.ttft_ms / 1e3:
            seen.update(full[by_sent[j]])
            j += 1
        own = set(full[i])  # this request's own blocks do not count
        hit = 0
        for h in hasher.hash_blocks(t.prompt):
            if seen[h] - (h in own) <= 0:
                break
            hit += 1
        bounds[i] = min(hit, (len(t.prompt) - 1) // block_size) * block_size
    return bounds


def flush_all(admin: str, token: str | None = None) -> int:
    """Evict every node's unused cached blocks; wait until Redis shows them gone."""
    import grpc

    from proto import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(admin) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        nodes = stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=30).nodes
        flushed = sum(
            stub.FlushCache(
                admin_pb2.FlushCacheRequest(node_id=n.node_id), timeout=60
            ).blocks_flushed
            for n in nodes
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            nodes = stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=30).nodes
            if all(n.cached_blocks == 0 and n.running + n.waiting == 0 for n in nodes):
                return flushed
            time.sleep(0.2)
    raise RuntimeError("the nodes' caches did not empty after FlushCache")


def start_routers(
    cluster, policies: list[str], model: str, log_dir: str, extra: list[str]
) -> dict[str, tuple[subprocess.Popen, str]]:
    """One router process per policy, all launched before any is waited for:
    each spends seconds importing the engine's stack, and they overlap. On a
    failure every one already launched is killed, not left behind."""
    from common.grpc_server import wait_serving
    from pdserve.redis_server import free_port

    launched: dict[str, tuple[subprocess.Popen, str, str]] = {}
    try:
        for policy in policies:
            port, admin_port = free_port(), free_port()
            log = Path(log_dir) / f"router-{policy}.log"
            with open(log, "w") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pdserve.cli", "router", "--model", model]
                    + ["--redis-url", cluster.redis_url, "--host", "127.0.0.1"]
                    + ["--port", str(port), "--admin-port", str(admin_port)]
                    + ["--routing-policy", policy, *extra],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            launched[policy] = (proc, f"127.0.0.1:{port}", str(log))
        deadline = time.monotonic() + 120
        for policy, (proc, address, log) in launched.items():
            # In slices, so that a router that exits (a bad flag) fails at once.
            while not wait_serving(address, 1.0, "pdserve.v1.Router"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {policy} router did not start (log: {log})")
    except BaseException:
        for proc, _, _ in launched.values():
            proc.kill()
            proc.wait(timeout=30)
        raise
    return {policy: (proc, address) for policy, (proc, address, _) in launched.items()}


def run_workload(args: argparse.Namespace) -> dict[str, Any]:
    from engine.models.config import ModelArchConfig
    from pdserve.launcher import ClusterSpec, LocalCluster
    from pdserve.redis_server import free_port

    log_dir = tempfile.mkdtemp(prefix="pdserve-routing-")
    engine_args = ["--max-model-len", str(args.max_model_len)]
    router_args: list[str] = []
    model = args.model
    if args.shape:
        from engine.models.shapes import write_shape_dir

        model = str(write_shape_dir(args.shape, Path(log_dir) / args.shape))
        engine_args += ["--load-format", "dummy", "--skip-tokenizer-init"]
        router_args += ["--skip-tokenizer-init"]
    if args.device != "auto":
        engine_args += ["--device", args.device]
    vocab = ModelArchConfig.from_dir(model).vocab_size
    w = make_workload(args, vocab)
    if args.num_kvcache_blocks:
        engine_args += ["--num-kvcache-blocks", str(args.num_kvcache_blocks)]
    spec = ClusterSpec(
        model=model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        port=free_port(),
        admin_port=free_port(),
        engine_args=engine_args,
        node_args=["--heartbeat-interval", str(args.heartbeat_s)],
        router_args=router_args,
        log_dir=log_dir,
    )
    results: dict[str, Any] = {"model": args.shape or args.model, "logs": log_dir}
    with LocalCluster(spec) as cluster:
        routers = start_routers(cluster, args.policies, model, log_dir, router_args)
        try:
            for policy in args.policies:
                flushed = flush_all(cluster.admin_address)
                turns: list[Turn] = []
                lock = threading.Lock()

                total = args.users * args.turns
                done = [0]

                def tick(policy=policy, done=done, total=total) -> None:
                    with lock:
                        done[0] += 1
                        if done[0] % max(1, total // 10) == 0 or done[0] == total:
                            print(f"  {policy}: {done[0]}/{total} requests", flush=True)

                def one(user: int, address=routers[policy][1], out=turns) -> None:
                    mine: list[Turn] = []
                    run_conversation(address, w, user, args, mine, tick)
                    with lock:
                        out.extend(mine)

                start = time.monotonic()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    list(pool.map(one, range(args.users)))
                elapsed = time.monotonic() - start
                results[policy] = score(turns, args.block_size, elapsed, flushed)
                r = results[policy]
                print(
                    f"{policy:>12}: hit rate {r['hit_rate']:.1%} "
                    f"(best possible {r['best_hit_rate']:.1%}, {r['fraction_of_best']:.1%} of it), "
                    f"TTFT p50 {r['ttft']['p50_ms']:.0f} ms p90 {r['ttft']['p90_ms']:.0f} ms, "
                    f"{r['local_prefill_fraction']:.0%} prefilled on the decode node, {elapsed:.0f} s",
                    flush=True,
                )
        finally:
            for proc, _ in routers.values():
                proc.terminate()
                proc.wait(timeout=30)
    if "cost" in results and "round-robin" in results:
        rr = results["round-robin"]["hit_rate"]
        results["cost_vs_round_robin_hit_rate"] = results["cost"]["hit_rate"] / rr if rr else None
    if "cost" in results and "random" in results:
        rr = results["random"]["ttft"]["p50_ms"]
        results["cost_vs_random_ttft_p50"] = results["cost"]["ttft"]["p50_ms"] / rr
    return results


def score(turns: list[Turn], block_size: int, elapsed: float, flushed: int) -> dict[str, Any]:
    bounds = best_possible(turns, block_size)
    prompt = sum(len(t.prompt) for t in turns)
    cached = sum(t.cached for t in turns)
    best = sum(bounds)
    return {
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "best_cached_tokens": best,
        "hit_rate": cached / prompt,
        "best_hit_rate": best / prompt,
        "fraction_of_best": cached / best if best else None,
        "ttft": summary_ms([t.ttft_ms for t in turns]),
        "ttft_later_turns": summary_ms([t.ttft_ms for t in turns if t.turn > 0]),
        "local_prefill_fraction": sum(not t.prefill_node for t in turns) / len(turns),
        "requests_per_decode_node": dict(sorted(Counter(t.decode_node for t in turns).items())),
        "requests_per_prefill_node": dict(
            sorted(Counter(t.prefill_node or "(local)" for t in turns).items())
        ),
        "output_tokens": sum(len(t.output) for t in turns),
        "elapsed_s": elapsed,
        "blocks_flushed_before": flushed,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["both", "workload", "decision"], default="both")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="models/smollm2-135m-instruct")
    src.add_argument("--shape", help="named shape, dummy weights (the workload is token ids)")
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="the nodes' device"
    )
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--systems", type=int, default=4, help="shared system prompts")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--users", type=int, default=24, help="conversations")
    p.add_argument("--turns", type=int, default=5, help="turns per conversation")
    p.add_argument("--min-user-tokens", type=int, default=48)
    p.add_argument("--max-user-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kvcache-blocks", type=int, default=0, help="per node; 0: engine default")
    p.add_argument("--heartbeat-s", type=float, default=0.2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decision-prompt-tokens", type=int, default=8192)
    p.add_argument("--decision-nodes", type=int, default=16)
    p.add_argument("--other-blocks", type=int, default=20_000)
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if set(args.policies) - set(POLICIES):
        p.error(f"--policies: choose from {', '.join(POLICIES)}")
    results: dict[str, Any] = {}
    if args.part in ("both", "decision"):
        results["decision"] = asyncio.run(decision_latency(args))
    if args.part in ("both", "workload"):
        results["workload"] = run_workload(args)
    return save_run("routing", args, results, argv)


if __name__ == "__main__":
    main()
