"""Which part of the model each tensor-parallel rank holds (torch-free arithmetic).

Megatron-style sharding of a decoder layer over ``size`` ranks:

- attention heads: rank r holds query heads ``[r*h/t, (r+1)*h/t)``; its KV heads
  are the ones those queries read: a contiguous ``kv/t`` of them when the KV
  heads divide among the ranks, else ONE head, replicated on ``t/kv`` ranks
  (GQA keeps every query group inside one KV head, so this is exact);
- q/k/v and gate/up are column-parallel (each rank computes its heads / its
  slice of the intermediate size); o and down are row-parallel (each rank
  multiplies its slice of the input; an all-reduce sums the partial outputs);
- the embedding and the LM head are vocabulary-parallel: rank r holds rows
  ``[r*s, (r+1)*s)`` with ``s = ceil(vocab/t)`` (the last shard padded with
  zero rows, so every rank's shard has the same shape for the all-gather);
- a mixture-of-experts MLP keeps every expert on every rank and shards each
  expert's intermediate dimension like a dense MLP's (gate/up rows, down
  columns; one all-reduce after the experts and the shared expert together).
  The router is replicated. Expert parallelism (a contiguous range of whole
  experts per rank, ``local_experts``) would change only which experts a rank
  holds: the fused MoE layer already maps global expert ids to local ones and
  skips the others (engine/layers/moe/).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_TENSOR_PARALLEL_SIZE = 8


def check_tensor_parallel_size(
    size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    expert_sizes: tuple[int, ...] = (),
) -> None:
    """ValueError naming the reason when the model cannot be split over ``size`` ranks."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(
            f"tensor_parallel_size must be between 1 and {MAX_TENSOR_PARALLEL_SIZE}; got {size}"
        )
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {num_kv_heads} KV heads: one must "
            "divide the other (KV heads are split among the ranks, or each replicated on "
            "several)"
        )
    if intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's intermediate size "
            f"{intermediate_size}"
        )
    for n in expert_sizes:
        if n % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide each expert's intermediate size {n}"
            )


def expert_sizes(cfg) -> tuple[int, ...]:
    """The intermediate sizes of a model's experts and shared expert (none if dense)."""
    moe = cfg.moe
    if moe is None:
        return ()
    shared = moe.shared_expert_intermediate_size
    return (moe.intermediate_size, shared) if shared else (moe.intermediate_size,)


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> range:
    """The KV heads (global indices) rank ``rank`` of ``size`` holds: a contiguous
    ``kv/size`` of them, or one head replicated on ``size/kv`` ranks."""
    if size > num_kv_heads:
        first = rank * num_kv_heads // size
        return range(first, first + 1)
    n = num_kv_heads // size
    return range(rank * n, (rank + 1) * n)


@dataclass(slots=True, frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # the whole model's
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def for_model(cls, cfg, rank: int = 0, size: int = 1) -> TPLayout:
        """``cfg``: an engine.models.config.ModelArchConfig."""
        check_tensor_parallel_size(
            size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
            expert_sizes(cfg),
        )
        moe = cfg.moe
        return cls(
            rank,
            size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            moe.num_experts if moe else 0,
            moe.intermediate_size if moe else 0,
            moe.shared_expert_intermediate_size if moe else 0,
        )

    # --------------------------------------------------------------- heads
    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_replicated(self) -> bool:
        return self.size > self.num_kv_heads

    @property
    def num_local_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.num_kv_heads // self.size

    @property
    def q_heads(self) -> range:
        n = self.num_local_heads
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads (global indices)."""
        return kv_head_range(self.rank, self.size, self.num_kv_heads)

    def kv_head_ranks(self, kv_head: int) -> list[int]:
        """The ranks that hold global KV head ``kv_head`` (several when replicated)."""
        return [r for r in range(self.size) if kv_head in self.at_rank(r).kv_heads]

    def at_rank(self, rank: int) -> TPLayout:
        return replace(self, rank=rank)

    # ----------------------------------------------------------------- MLP
    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def intermediate_range(self) -> range:
        n = self.local_intermediate
        return range(self.rank * n, (self.rank + 1) * n)

    # ------------------------------------------------------------- experts
    @property
    def local_experts(self) -> range:
        """The experts (global ids) this rank holds: all of them (tensor
        parallelism shards each expert; expert parallelism would split this)."""
        return range(self.num_experts)

    @property
    def local_expert_intermediate(self) -> int:
        return self.expert_intermediate_size // self.size

    @property
    def expert_intermediate_range(self) -> range:
        n = self.local_expert_intermediate
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def local_shared_intermediate(self) -> int:
        return self.shared_expert_intermediate_size // self.size

    @property
    def shared_intermediate_range(self) -> range:
        n = self.local_shared_intermediate
        return range(self.rank * n, (self.rank + 1) * n)

    # ---------------------------------------------------------- vocabulary
    @property
    def vocab_shard_size(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_range(self) -> range:
        """The vocabulary rows this rank holds (the last shard may hold fewer than
        ``vocab_shard_size``: the rest of its rows are padding)."""
        s = self.vocab_shard_size
        return range(min(self.rank * s, self.vocab_size), min((self.rank + 1) * s, self.vocab_size))
