"""The host KV tier's measurement in ``serve_side_by_side.py``: a multi-turn
workload whose conversations outgrow the KV pool on purpose, the tier's own
copy-in rate from a pdserve node's /metrics, and the host's plain copy rate
to set it against.

The working set is every conversation's KV at its end: the shared system
prompts once, and each user's messages and replies (a message's mean length,
the dataset's min and max averaged). The pool is sized from it, so that the
working set is ``ratio`` pools, and is the same number of blocks on every
system: pdserve's ``--num-kvcache-blocks`` and vLLM's
``--num-gpu-blocks-override`` with ``--block-size`` set alike.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from engine.models.config import ModelArchConfig
from pdserve.bench.datasets import MultiTurnSpec

GiB = 1 << 30
BLOCK_SIZE = 16  # tokens a KV block holds, set on every system alike

# The GPU run's conversations (MultiTurnSpec's fields; ``--multi-turn`` changes
# them): the longest (1024 + 6 x (320 + 128) tokens) fits max_model_len 4096;
# 48 users keep four systems' sweeps of two rates within one device command.
GPU_CONVERSATIONS = MultiTurnSpec(
    users=48,
    turns=6,
    systems=4,
    system_tokens=1024,
    min_user_tokens=128,
    max_user_tokens=320,
    output_tokens=128,
)


def parse_spec(items: list[str]) -> MultiTurnSpec:
    """``FIELD=N`` items over GPU_CONVERSATIONS (``users=8 turns=3``)."""
    known = {f.name for f in fields(MultiTurnSpec)}
    values = asdict(GPU_CONVERSATIONS)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"--multi-turn takes FIELD=N with N >= 1, FIELD one of {sorted(known)}; "
                f"got {item!r}"
            )
        values[key] = int(value)
    spec = MultiTurnSpec(**values)
    if spec.min_user_tokens > spec.max_user_tokens:
        raise ValueError("--multi-turn: min_user_tokens is above max_user_tokens")
    return spec


def bench_args(spec: MultiTurnSpec) -> list[str]:
    """`pdserve bench serve`'s flags for these conversations."""
    return [
        "--dataset",
        "multi-turn",
        *("--multi-turn-users", str(spec.users), "--multi-turn-turns", str(spec.turns)),
        *("--multi-turn-systems", str(spec.systems)),
        *("--multi-turn-system-len", str(spec.system_tokens)),
        *("--multi-turn-min-user-len", str(spec.min_user_tokens)),
        *("--multi-turn-max-user-len", str(spec.max_user_tokens)),
        *("--random-output-len", str(spec.output_tokens)),
    ]


def kv_bytes_per_token(arch: ModelArchConfig) -> int:
    """K and V of every layer for one token, in the config's dtype (the pool's
    without an FP8 KV cache)."""
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[arch.torch_dtype or "bfloat16"]
    return arch.kv_bytes_per_token(elem)


@dataclass(slots=True)
class WorkingSet:
    """The conversations' KV against the pool they run on."""

    tokens: int
    bytes: int
    longest_tokens: int  # one conversation's last prompt and reply
    pool_blocks: int
    pool_tokens: int
    ratio: float  # working set over pool, in tokens
    host_tier_gib: float  # what holds the working set (with a quarter to spare)

    @classmethod
    def size(
        cls, spec: MultiTurnSpec, arch: ModelArchConfig, ratio: float, max_model_len: int
    ) -> WorkingSet:
        mean_user = (spec.min_user_tokens + spec.max_user_tokens) / 2
        per_user = spec.turns * (mean_user + spec.output_tokens)
        tokens = int(spec.systems * spec.system_tokens + spec.users * per_user)
        longest = spec.system_tokens + spec.turns * (spec.max_user_tokens + spec.output_tokens)
        if longest > max_model_len:
            raise ValueError(
                f"a conversation reaches {longest} tokens, past max_model_len {max_model_len}"
            )
        # At least one full-length sequence: both servers refuse a smaller pool.
        blocks = max(math.ceil(tokens / ratio / BLOCK_SIZE), -(-max_model_len // BLOCK_SIZE))
        per_token = kv_bytes_per_token(arch)
        return cls(
            tokens=tokens,
            bytes=tokens * per_token,
            longest_tokens=longest,
            pool_blocks=blocks,
            pool_tokens=blocks * BLOCK_SIZE,
            ratio=round(tokens / (blocks * BLOCK_SIZE), 3),
            host_tier_gib=round(math.ceil(1.25 * tokens * per_token / GiB * 1000) / 1000, 3),
        )


def copy_rate(num_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    """The host's plain copy rate into the KV pool's memory: a pinned host
    buffer to the GPU (CUDA events around each copy, the best of
    ``repeats``), or, without a GPU, one host buffer to another (wall time),
    which is what the tier's copies are on a CPU engine."""
    import torch

    if torch.cuda.is_available():
        src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)  # the first copy pays for setup
        best = math.inf
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        device, how = torch.cuda.get_device_name(), "pinned host to device, CUDA events"
    else:
        src, dst = (
            torch.ones(num_bytes, dtype=torch.uint8),
            torch.empty(num_bytes, dtype=torch.uint8),
        )
        dst.copy_(src)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        device, how = "cpu", "host to host, wall time"
    return {
        "device": device,
        "how": how,
        "bytes": num_bytes,
        "seconds": best,
        "bytes_per_s": num_bytes / best,
    }


# A pdserve node's host-tier series (common/metrics/node.py): sample -> field.
TIER_SAMPLES = {
    ("pdserve_host_kv_blocks_capacity", ""): "host_kv_blocks",
    ("pdserve_host_tier_hit_blocks_total", ""): "hit_blocks",
    ("pdserve_kv_tier_copied_blocks_total", "to_host"): "blocks_to_host",
    ("pdserve_kv_tier_copied_blocks_total", "to_device"): "blocks_to_device",
    ("pdserve_kv_tier_copied_bytes_total", "to_device"): "bytes_to_device",
    ("pdserve_kv_tier_copy_in_seconds_total", ""): "copy_in_seconds",
}


def tier_counters(metrics_url: str) -> dict:
    """The node's host-tier counters since it started, and its copy-in rate
    (bytes to the device over their seconds on the bus; None without any)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(TIER_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("direction", ""))
            if key in TIER_SAMPLES:
                out[TIER_SAMPLES[key]] += s.value
    seconds = out["copy_in_seconds"]
    out["copy_in_bytes_per_s"] = out["bytes_to_device"] / seconds if seconds > 0 else None
    return out


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
