"""Launch configurations of the fused MoE kernel, tuned per GPU like the skinny GEMM's.

Tables: ``engine/layers/moe_configs/<GPU name>.json``, written by
``python -m engine.layers.moe.tune --write-table`` on that GPU:
``{"bfloat16": {"E128_N768_K2048_k8": {"1": {"config": {...}, "fused_us": ...},
...}}}``, keyed by the expert count, one expert's intermediate size on this
rank (N; gate/up has 2N rows), the hidden size (K) and top-k, then by token
count. A count between tuned ones takes the next tuned one up (the largest
beyond them). A shape no table has gets ``default_config``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.layers.tuned_tables import read_table, table_file_name

CONFIG_DIR = Path(__file__).resolve().parent.parent / "moe_configs"


@dataclass(slots=True, frozen=True)
class MoeKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MoeKernelConfig:
        return cls(**d)


def shape_key(num_experts: int, n: int, k: int, top_k: int) -> str:
    return f"E{num_experts}_N{n}_K{k}_k{top_k}"


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeKernelConfig:
    """Untuned: small tiles while each expert sees few tokens (decode: the
    weights are read once and the tile's rows are mostly padding), larger ones
    when experts see many (prefill: tensor-core bound)."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        return MoeKernelConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoeKernelConfig(32, 64, 64, group_m=8, num_warps=4, num_stages=3)
    return MoeKernelConfig(64, 128, 64, group_m=8, num_warps=8, num_stages=3)


@functools.cache
def load_table(path: Path) -> dict:
    return read_table(path, "fused MoE", "using default configs")


def tuned_entry(entries: dict, num_tokens: int) -> dict | None:
    """The entry for the smallest tuned token count >= ``num_tokens`` (else the largest)."""
    if not entries:
        return None
    counts = sorted(int(m) for m in entries)
    m = next((c for c in counts if c >= num_tokens), counts[-1])
    return entries[str(m)]


def config_for(
    device_name: str | None,
    dtype: str,
    num_tokens: int,
    num_experts: int,
    n: int,
    k: int,
    top_k: int,
) -> MoeKernelConfig:
    """The tuned config of this GPU for the shape and token count, else the default."""
    if device_name is not None:
        table = load_table(CONFIG_DIR / table_file_name(device_name))
        entries = table.get(dtype, {}).get(shape_key(num_experts, n, k, top_k), {})
        entry = tuned_entry(entries, num_tokens)
        if entry is not None:
            return MoeKernelConfig.from_dict(entry["config"])
    return default_config(num_tokens, num_experts, top_k)
