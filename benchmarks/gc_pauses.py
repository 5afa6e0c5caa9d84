"""How long a full garbage collection pauses a node process, before and after
``gc.freeze`` (common/runtime/gc_heap.py), with requests alive in the engine.

    python benchmarks/gc_pauses.py --shape smollm2-135m             # CPU, dummy weights
    python benchmarks/gc_pauses.py --shape llama-3.1-8b --device cuda

Builds what a decode node holds after start-up (the node's modules, grpc, an
``LLMEngine`` on dummy weights of ``--shape``, its CUDA graphs on a GPU), adds
``--live-requests`` requests and runs a few steps so their objects exist, then
times ``--collections`` full collections (``gc.collect()``); then freezes the
heap, serves as many requests again (these are not frozen, as in service) and
times as many full collections. A full collection stops every thread of the process,
so its time is added to every first token it lands on.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run


def time_collections(n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--live-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--collections", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)

    import decode_node.main  # noqa: F401 - a node's modules: grpc, redis, protobuf
    import router.http.app  # noqa: F401 - FastAPI, pydantic: what the router holds
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.shapes import write_shape_dir
    from engine.sampling_params import SamplingParams

    model = write_shape_dir(args.shape, tempfile.mkdtemp(prefix="gc-pauses-"))
    kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 2048}
    if args.device == "cpu":
        kwargs |= {"device": "cpu", "enforce_eager": True}
    engine = LLMEngine(EngineConfig.from_kwargs(str(model), **kwargs))
    params = SamplingParams(max_tokens=1_000, ignore_eos=True)

    def serve(batch: int) -> None:
        """``--live-requests`` more requests, prefilled and decoding: their objects exist."""
        for i in range(args.live_requests):
            prompt = [(i * 7919 + j + batch) % 1000 + 10 for j in range(args.prompt_len)]
            engine.add_request(f"b{batch}-r{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(3):
            engine.step()

    serve(0)
    results: dict = {"tracked_objects": len(gc.get_objects())}
    results["unfrozen_ms"] = time_collections(args.collections)
    # As a node does once serving (start-up's heap: the first batch stands in for
    # nothing in service, it is frozen with it); then requests arrive as in service.
    gc.freeze()
    results["frozen_objects"] = gc.get_freeze_count()
    serve(1)
    results["tracked_after_freeze"] = len(gc.get_objects())
    results["frozen_ms"] = time_collections(args.collections)
    gc.unfreeze()
    for key in ("unfrozen_ms", "frozen_ms"):
        print(f"{key}: p50 {statistics.median(results[key]):.2f} ms  {results[key]}")
    print(
        f"tracked objects {results['tracked_objects']}, frozen {results['frozen_objects']}, "
        f"tracked after freeze {results['tracked_after_freeze']}"
    )
    save_run("gc_pauses", args, results, argv)


if __name__ == "__main__":
    main()
