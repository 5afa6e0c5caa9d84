"""Time to first token through a real cluster: where it goes, what disaggregation and the router add.

    python benchmarks/disagg_ttft.py --shape llama-3.1-8b --prompt-tokens 2048   # 2 GPUs
    python benchmarks/disagg_ttft.py --model models/smollm2-135m-instruct --prompt-tokens 512

Starts Redis, one prefill node, one decode node and the router (`pdserve up`'s
launcher; one GPU per node when there are GPUs), once per ``--kv-stream-layers``
value (the prefill node's layers per KV chunk; 0: each step's KV in one chunk
after its last layer) and ``--kv-stream-last-layers`` value (only the last N
layers streamed, the ones before in one chunk), ``--repeat`` times in turn.
Each round sends the same kind of request three times, interleaved: through
the router; straight to the nodes as the router sends it (the Prefill to the
prefill node beside the request to the decode node, through the router's own
session classes: benchmarks/direct_client.py); and straight to the decode node
naming no prefill node, so that it prefills the prompt itself (a local
prefill, the baseline of the disaggregation tax). Prompts are random token ids,
new each time (no prefix-cache hits); with ``--same-prompt`` a round's two direct
requests share one (they go to different nodes), so that the paths are compared
on the same data. Reports median TTFTs (router minus direct is the router's and
its extra hop's cost; direct over local the disaggregation's), and the
breakdown the nodes report: prefill queue, prefill compute, the KV transfer
left after the prompt's last layer (from the Prefill's reply, which this
client awaits after the stream), and the decode node's admission, its wait for
the KV and the first token, and its first message.

``--local-gpu prefill`` runs the local baseline on the prefill node's own GPU:
two decode nodes, the first sharing the prefill node's GPU (it prefills the
local requests there), the second on the other GPU (it takes the
disaggregated ones). Both paths' prefills then run on one device, in turn, so
a difference between devices (or the heat of the one that does two of every
three prefills) is not counted as disaggregation's. Each node gets a fixed KV
pool (``--num-kvcache-blocks``): two engines on one GPU cannot both size
theirs from its free memory. No router requests in this mode: it might pair
the two processes of one GPU, which NCCL refuses.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run
from benchmarks.direct_client import DirectClient


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def copy_engine_gathers(redis_url: str) -> int:
    """prefill-0's KV chunks gathered by its GPU's copy engines, from its last heartbeat."""
    import asyncio

    from common.cluster.state import Cluster

    async def read():
        cluster = Cluster.from_url(redis_url)
        try:
            nodes = {n.node_id: n for n in await cluster.nodes()}
            return nodes["prefill-0"].kv_gathers_copy_engine
        finally:
            await cluster.close()

    return asyncio.run(read())


def run(args: argparse.Namespace, stream_layers: int, last_layers: int | None) -> dict[str, Any]:
    import grpc

    from common.wire import prefill_reply_timings
    from engine.models.config import ModelArchConfig
    from engine.models.shapes import write_shape_dir
    from pdserve.launcher import ClusterSpec, LocalCluster
    from pdserve.redis_server import free_port
    from proto import internal_pb2, pdserve_pb2, pdserve_pb2_grpc

    tmp = tempfile.mkdtemp(prefix="pdserve-ttft-")
    same_gpu = args.local_gpu == "prefill"
    engine_args = ["--max-model-len", str(args.max_model_len)]
    if same_gpu:
        engine_args += ["--num-kvcache-blocks", str(args.num_kvcache_blocks)]
    router_args = []
    if args.shape:
        model = str(write_shape_dir(args.shape, Path(tmp) / args.shape))
        engine_args += ["--load-format", "dummy", "--skip-tokenizer-init"]
        router_args += ["--skip-tokenizer-init"]
    else:
        model = args.model
    vocab = ModelArchConfig.from_dir(model).vocab_size
    prefill_env = {"PDSERVE_KV_STREAM_LAYERS": str(stream_layers)}
    if last_layers is not None:  # else the node's own default
        prefill_env["PDSERVE_KV_STREAM_LAST_LAYERS"] = str(last_layers)
    # The launcher hands GPUs out in turn, decode nodes first: with two GPUs
    # decode-0 and prefill-0 share the first (checked below).
    num_decode = 2 if same_gpu else 1
    spec = ClusterSpec(
        model=model,
        num_prefill=1,
        num_decode=num_decode,
        port=free_port(),
        admin_port=free_port(),
        engine_args=engine_args,
        router_args=router_args,
        component_env={"prefill-0": prefill_env},
        log_dir=str(Path(tmp) / "logs"),
        start_timeout_s=900,
    )
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    with LocalCluster(spec) as cluster:
        by_name = {c.name: c for c in cluster.components}
        router = pdserve_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))

        def ref(name: str, tp: int = 1) -> internal_pb2.NodeRef:
            c = by_name[name]
            return internal_pb2.NodeRef(node_id=name, address=c.address, tensor_parallel_size=tp)

        if same_gpu:
            local_node, remote_node = by_name["decode-0"], by_name["decode-1"]
            if local_node.gpus != by_name["prefill-0"].gpus or (
                local_node.gpus is not None and remote_node.gpus == local_node.gpus
            ):
                raise SystemExit(
                    "--local-gpu prefill needs decode-0 on the prefill node's GPU and decode-1 "
                    f"on another; the launcher gave decode-0 {local_node.gpus}, decode-1 "
                    f"{remote_node.gpus}, prefill-0 {by_name['prefill-0'].gpus} (2 GPUs needed)"
                )
        local_decode = ref("decode-0")
        remote_decode = ref("decode-1" if same_gpu else "decode-0")
        sampling = pdserve_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prefill_ref = ref("prefill-0")
        client = DirectClient()

        def prompt() -> list[int]:
            return [rng.randrange(100, min(vocab, 30000)) for _ in range(args.prompt_tokens)]

        def first_token_ms(stream) -> tuple[float, pdserve_pb2.Final]:
            start = time.perf_counter()
            ttft, final = None, None
            for response in stream:
                if ttft is None and any(d.token_ids for d in response.deltas):
                    ttft = (time.perf_counter() - start) * 1e3
                if response.HasField("final"):
                    final = response.final
            return ttft, final

        def direct(remote: bool, ids: list[int]) -> tuple[float, pdserve_pb2.Final]:
            node = remote_decode if remote else local_decode
            prefill = prefill_ref if remote else None
            ttft, final, reply = client.generate(node, prefill, ids, sampling, uuid.uuid4().hex)
            if reply is not None:  # awaited after the stream, where the router does not wait
                prefill_reply_timings(reply, final.usage)
            return ttft, final

        def pause() -> None:
            # Each path's GPU starts from the same idle (clocks, power), not
            # from another path's prefill just before.
            if args.pause_ms:
                time.sleep(args.pause_ms / 1e3)

        for i in range(args.warmup + args.requests):
            via_router = None
            if not same_gpu:
                pause()
                via_router = first_token_ms(
                    router.Generate(
                        pdserve_pb2.GenerateRequest(
                            token_ids=pdserve_pb2.TokenIds(ids=prompt()), sampling=sampling
                        ),
                        timeout=600,
                    )
                )
            pause()
            ids = prompt()
            remote = direct(True, ids)
            pause()
            # Another node each (decode-1 and prefill-0, decode-0): no prefix-cache hit.
            local = direct(False, ids if args.same_prompt else prompt())
            if i < args.warmup:
                continue
            assert remote[1].usage.prefill_node == "prefill-0" and not local[1].usage.prefill_node
            t, lt = remote[1].usage.timing, local[1].usage.timing
            row = {
                "direct_ttft_ms": remote[0],
                "local_ttft_ms": local[0],
                "decode_admit_ms": t.decode_admit_ms,
                "kv_wait_ms": t.kv_wait_ms,
                "prefill_node_ms": t.prefill_node_ms,
                "prefill_queue_ms": t.prefill_queue_ms,
                "prefill_compute_ms": t.prefill_compute_ms,
                "kv_transfer_ms": t.kv_transfer_ms,
                # Its time the engine and the wire do not account for; may be < 0:
                # compute runs to the first token, the exposed KV from the last
                # layer's end, so the two can overlap.
                "prefill_node_unattributed_ms": t.prefill_node_ms
                - t.prefill_queue_ms
                - t.prefill_compute_ms
                - t.kv_transfer_ms,
                "decode_first_output_ms": t.decode_first_output_ms,
                "local_queue_ms": lt.prefill_queue_ms,
                "local_compute_ms": lt.prefill_compute_ms,
                "paired_ttft_diff_ms": remote[0] - local[0],
                # 0 on both paths: prompts are new each round, and a shared one
                # (--same-prompt) goes to two different nodes.
                "direct_cached_tokens": remote[1].usage.cached_tokens,
                "local_cached_tokens": local[1].usage.cached_tokens,
            }
            if via_router is not None:
                row["router_ttft_ms"] = via_router[0]
                row["router_reported_ttft_ms"] = via_router[1].usage.time_to_first_token_ms
            rows.append(row)
        # What prefill-0 counted (its next heartbeat).
        time.sleep(1.5)
        gathers = copy_engine_gathers(cluster.redis_url)
        client.close()
    keys = rows[0].keys()
    summary = {f"median_{k}": median([r[k] for r in rows]) for k in keys}
    if not same_gpu:
        summary["router_overhead_ms"] = (
            summary["median_router_ttft_ms"] - summary["median_direct_ttft_ms"]
        )
    summary["disaggregated_vs_local"] = (
        summary["median_direct_ttft_ms"] / summary["median_local_ttft_ms"]
    )
    # The spread of a round's direct-minus-local TTFT: how far one run's medians can move.
    diffs = sorted(r["paired_ttft_diff_ms"] for r in rows)
    summary["paired_ttft_diff_p25_ms"] = diffs[len(diffs) // 4]
    summary["paired_ttft_diff_p75_ms"] = diffs[(3 * len(diffs)) // 4]
    summary["transfer_share_of_ttft"] = (
        summary["median_kv_transfer_ms"] / summary["median_direct_ttft_ms"]
    )
    summary["remote_requests"] = args.warmup + args.requests
    # KV chunks prefill-0 gathered by its GPU's copy engines (0: by kernels, or a CPU).
    summary["kv_gathers_copy_engine"] = gathers
    return {
        "local_gpu": args.local_gpu,
        "kv_stream_layers": stream_layers,
        "kv_stream_last_layers": last_layers,
        "rows": rows,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="named shape, dummy weights (token-id prompts)")
    src.add_argument("--model", help="HF model directory")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--kv-stream-layers", default="1", help="values to compare, e.g. 1,0")
    p.add_argument(
        "--kv-stream-last-layers",
        default=None,
        help="values to compare, e.g. 0,4 (default: the prefill node's own default)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="run the settings in turn this many times (ABAB)"
    )
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--pause-ms", type=float, default=0.0, help="idle time before each request, ms")
    p.add_argument(
        "--local-gpu",
        choices=("decode", "prefill"),
        default="decode",
        help="where the local baseline prefills: the decode node's GPU, or the prefill "
        "node's (a second decode node shares it; no router requests)",
    )
    p.add_argument(
        "--same-prompt",
        action="store_true",
        help="with --local-gpu prefill: a round's disaggregated and local requests get the "
        "same prompt (on other nodes, so no prefix-cache hit), so that the two paths are "
        "compared on the same data",
    )
    p.add_argument(
        "--num-kvcache-blocks",
        type=int,
        default=1024,
        help="each node's KV pool with --local-gpu prefill (two engines share a GPU)",
    )
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    if args.same_prompt and args.local_gpu != "prefill":
        # One decode node would take both requests of a round: the second would hit
        # the first's prefix cache.
        p.error("--same-prompt needs --local-gpu prefill (a decode node for each path)")
    results = []
    lasts = [None] if args.kv_stream_last_layers is None else args.kv_stream_last_layers.split(",")
    settings = [
        (int(layers), None if last is None else int(last))
        for layers in args.kv_stream_layers.split(",")
        for last in lasts
    ]
    for layers, last in settings * args.repeat:
        result = run(args, layers, last)
        results.append(result)
        s = result["summary"]
        shown = "default" if last is None else last
        via_router = (
            f"via router {s['median_router_ttft_ms']:.2f} ms, " if "router_overhead_ms" in s else ""
        )
        router_hop = (
            f", router + hop {s['router_overhead_ms']:.2f} ms" if "router_overhead_ms" in s else ""
        )
        print(
            f"--kv-stream-layers {layers} --kv-stream-last-layers {shown} --local-gpu "
            f"{args.local_gpu}: TTFT p50 {via_router}"
            f"direct to the decode node {s['median_direct_ttft_ms']:.2f} ms, local prefill "
            f"{s['median_local_ttft_ms']:.2f} ms -> disaggregated/local "
            f"{s['disaggregated_vs_local']:.3f}x{router_hop}\n"
            f"  breakdown p50: prefill queue {s['median_prefill_queue_ms']:.2f} ms, compute "
            f"{s['median_prefill_compute_ms']:.2f} ms, KV left after the last layer "
            f"{s['median_kv_transfer_ms']:.2f} ms ({100 * s['transfer_share_of_ttft']:.1f}% of "
            f"TTFT), decode first output {s['median_decode_first_output_ms']:.2f} ms\n"
            f"  direct path p50: decode node admit {s['median_decode_admit_ms']:.2f} ms, then "
            f"KV and first token {s['median_kv_wait_ms']:.2f} ms; prefill node "
            f"{s['median_prefill_node_ms']:.2f} ms (unattributed there "
            f"{s['median_prefill_node_unattributed_ms']:.2f}), "
            f"first message {s['median_decode_first_output_ms']:.2f} ms\n"
            f"  local prefill p50: queue {s['median_local_queue_ms']:.2f} ms, compute "
            f"{s['median_local_compute_ms']:.2f} ms\n"
            f"  direct - local TTFT per round: p25 {s['paired_ttft_diff_p25_ms']:.2f}, p50 "
            f"{s['median_paired_ttft_diff_ms']:.2f}, p75 {s['paired_ttft_diff_p75_ms']:.2f} ms\n"
            f"  KV chunks gathered by the copy engines {s['kv_gathers_copy_engine']}",
            flush=True,
        )
    model = args.shape or args.model
    return save_run("disagg_ttft", args, {"model": model, "runs": results}, argv)


if __name__ == "__main__":
    main()
