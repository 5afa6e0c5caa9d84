"""The draft model: a second, smaller model in the same engine that proposes
tokens greedily (vLLM's "draft_model" method).

Its paged KV cache has as many blocks as the target's and is indexed by the
same block tables, so the block manager, slot mappings and prefix cache
serve both; only the tensors differ. Its KV is valid for a sequence's first
``num_draft_computed_tokens`` positions, never past the target-verified ones
(``num_computed_tokens``): each proposal first catches up from there (a whole
prompt the first time, which is how a prompt prefilled on another node gets
its draft KV: computed here, on the decode node), then runs one token per
further proposed position. A greedy request's proposals are the draft's
argmax: one token each, checked by comparison (engine/spec_decode/
speculator.py). A sampled request's are drawn from the draft's own
distribution (its logits at the request's temperature, within its
allowed_token_ids), kept in ``proposal_probs`` for the verify step's
rejection sampling (engine/spec_decode/rejection.py); a seeded request draws
from a generator seeded by its seed and length, so it stays reproducible.
Under tensor parallelism the draft is sharded over the target's ranks like
the target; rank 0 proposes, and each forward's plan goes to the other ranks
first (engine/parallel/handoff.py, ``Op.DRAFT``), which run their shard of it
(``follow``). A forward runs at most the engine's step budget of tokens: a
catch-up over several prompts (a decode node's remote prefills) is cut into
pieces, which also bounds the channel's message.
A shared prefix-cache block's draft KV is recomputed by every sequence that
starts on it (a new sequence's draft starts at position 0): its target KV may
have landed from a prefill node, which computes no draft KV.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device import default_dtype
from engine.layers.attention import select_backend
from engine.layers.specs import AttentionBackendName
from engine.models.config import ModelArchConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.loader import init_dummy_weights, load_weights
from engine.parallel.group import TPGroup
from engine.parallel.handoff import Logits, StepPlan
from engine.sequence import Sequence
from engine.spec_decode.rejection import DraftProbs
from engine.step_inputs import HostInputs, HostStaging, host_inputs, to_model_inputs
from engine.tp_layout import TPLayout

# Sets the draft's random stream apart from the target sampler's.
_DRAFT_STREAM = 0x5EED_D4AF


class DraftModel:
    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        backend: AttentionBackendName,
        dummy_weights_seed: int | None = None,
        seed: int = 0,
        max_tokens: int = 8192,
        tp: TPGroup | None = None,
    ) -> None:
        """``seed``: the engine's, for unseeded requests' draws; ``max_tokens``:
        the most tokens one forward runs (the engine's step budget); ``tp``:
        the target's ranks, over which the draft is sharded the same way."""
        self.cfg = cfg = ModelArchConfig.from_dir(model_dir)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.tp = tp if tp is not None else TPGroup.single(device)
        self.layout = TPLayout.for_model(cfg, self.tp.rank, self.tp.size)
        backend_cls = select_backend(backend, device, dtype, cfg)
        self.attention_backend = backend_cls(
            self.layout.num_local_heads, self.layout.num_local_kv_heads, cfg.head_dim,
            cfg.softmax_scale, block_size,
        )  # fmt: skip
        with torch.device(device), default_dtype(dtype):
            model = DecoderForCausalLM(
                cfg, self.attention_backend, max_model_len, False, self.tp, triton_moe=False
            )  # fmt: skip
        if dummy_weights_seed is not None:  # the target has dummy weights: so has its draft
            init_dummy_weights(model, dummy_weights_seed)
        else:
            load_weights(model, model_dir)
        self.model = model.eval()
        self.staging = HostStaging(device)
        self.kv_cache: torch.Tensor | None = None
        # By seq_id: [k, vocab] draft distributions of this step's sampled
        # proposals (a step's verify takes them; the next proposal clears them).
        self.proposal_probs: dict[int, torch.Tensor] = {}
        self.generator = torch.Generator(device=device)
        # Not the engine's seed itself: the target's sampler draws from that
        # stream, and the same draws here would tie each proposal to the token
        # sampled before it (a biased joint distribution).
        self.generator.manual_seed(seed ^ _DRAFT_STREAM)

    @property
    def block_bytes(self) -> int:
        cfg = self.cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * self.layout.num_local_kv_heads
            * (cfg.head_dim * elem)
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        kv = alloc(
            2, cfg.num_hidden_layers, num_blocks, self.block_size,
            self.layout.num_local_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device,
        )  # fmt: skip
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache = kv[0, i]
            attn.v_cache = kv[1, i]
        self.kv_cache = kv

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """``k`` greedy tokens to follow each sequence. Its blocks must hold
        positions up to ``len(token_ids) + k - 2`` (the last proposed token is
        never an input)."""
        tables = [s.block_table for s in seqs]
        for s in seqs:
            s.num_draft_computed_tokens = min(s.num_draft_computed_tokens, s.num_computed_tokens)
        token_lists = [s.token_ids for s in seqs]
        starts = [s.num_draft_computed_tokens for s in seqs]
        counts = [len(s.token_ids) - start for s, start in zip(seqs, starts, strict=True)]
        proposals: list[list[int]] = [[] for _ in seqs]
        probs: dict[int, list[torch.Tensor]] = {}
        gens = [self._generator_for(s) for s in seqs]
        for j in range(k):
            logits = self._next_logits(token_lists, starts, counts, tables)
            tokens = self._choose(seqs, logits, gens, probs)
            for p, t in zip(proposals, tokens, strict=True):
                p.append(t)
            # The next step feeds each sequence's newest proposed token.
            token_lists = [s.token_ids + p for s, p in zip(seqs, proposals, strict=True)]
            starts = [len(s.token_ids) + j for s in seqs]
            counts = [1] * len(seqs)
        for s in seqs:  # its KV now covers every position but the last proposed
            s.num_draft_computed_tokens = len(s.token_ids) + k - 1
        for seq_id, rows in probs.items():
            self.proposal_probs[seq_id] = torch.stack(rows)
        return proposals

    def _next_logits(
        self, token_lists: list[list[int]], starts: list[int], counts: list[int], tables
    ) -> torch.Tensor:
        """Each sequence's logits after its ``counts[i]`` tokens from
        ``starts[i]``, in forwards of at most ``max_tokens`` tokens: a
        catch-up over whole prompts may hold more than a step does (and than
        the hand-off channel to the other ranks is sized for)."""
        last_of: dict[int, torch.Tensor] = {}
        for pieces in pack_pieces(counts, self.max_tokens):
            host = host_inputs(
                [token_lists[i] for i, _, _ in pieces],
                [starts[i] + offset for i, offset, _ in pieces],
                [n for _, _, n in pieces],
                [tables[i] for i, _, _ in pieces],
                self.block_size,
            )
            logits = self._forward(host)
            for row, (i, offset, n) in enumerate(pieces):
                if offset + n == counts[i]:  # the sequence's last piece
                    last_of[i] = logits[row]
        return torch.stack([last_of[i] for i in range(len(counts))]).float()

    def _forward(self, host: HostInputs) -> torch.Tensor:
        """The logits at each sequence's last token of ``host``. Rank 0 of a
        tensor-parallel engine first sends the forward's plan to the others,
        which run their shard of it (``follow``)."""
        last = (host.query_start_loc[1:] - 1).astype(np.int64)
        if self.tp.size > 1:
            self.tp.handoff.send(StepPlan(host, logits=Logits.ROWS, logit_rows=last, draft=True))
        inputs, (rows,) = to_model_inputs(host, self.staging, [last])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Ranks 1..t-1: rank 0's draft forward, for its collectives (the
        logits computed are this rank's share of the all-gather)."""
        inputs, (rows,) = to_model_inputs(plan.host, self.staging, [plan.logit_rows])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self.model.compute_logits(hidden[rows])

    def _choose(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        gens: list[torch.Generator],
        probs: dict[int, list[torch.Tensor]],
    ) -> list[int]:
        """Each sequence's next proposed token: the argmax for a greedy request,
        else a draw from the draft's distribution (appended to ``probs``)."""
        tokens = logits.argmax(dim=-1)
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row = logits[i] / p.temperature
            if p.allowed_token_ids is not None:
                allowed = torch.tensor(p.allowed_token_ids, device=row.device)
                row = torch.full_like(row, float("-inf")).index_copy_(0, allowed, row[allowed])
            q = torch.softmax(row, dim=-1)
            expo = torch.empty_like(q).exponential_(generator=gens[i])
            tokens[i] = (q / expo.clamp_(min=torch.finfo(q.dtype).tiny)).argmax()
            probs.setdefault(seq.seq_id, []).append(q)
        return tokens.tolist()

    def take_probs(
        self,
        seqs: list[Sequence],
        first: list[int],
        generators: list[torch.Generator | None],
    ) -> DraftProbs | None:
        """The verify step's sampled proposals: ``seqs`` in sampling order,
        ``first[j]`` the sample row of ``seqs[j]``'s first position,
        ``generators[j]`` its request's own generator (seeded; the target's,
        never the draft's: the acceptance draws must not repeat the
        proposal's). Forgets the rest (proposals a step left out are made
        again)."""
        rows, tokens, probs, gens = [], [], [], []
        for seq, row, gen in zip(seqs, first, generators, strict=True):
            q = self.proposal_probs.get(seq.seq_id)
            num = len(seq.spec_token_ids)  # the scheduler may have cut it
            if q is None or not num:
                continue
            rows.extend(range(row, row + num))
            tokens.extend(seq.spec_token_ids)
            probs.append(q[:num])
            gens.extend([gen] * num)
        self.proposal_probs.clear()
        if not rows:
            return None
        dev = self.device
        return DraftProbs(
            torch.tensor(rows, dtype=torch.int64, device=dev),
            torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.cat(probs),
            gens,
        )

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        """A seeded request's draws depend on its seed and length only."""
        if seq.params.seed is None:
            return self.generator
        gen = torch.Generator(device=self.device)
        mixed = (seq.params.seed * 1_000_003 + len(seq.token_ids)) ^ _DRAFT_STREAM
        gen.manual_seed(mixed & 0xFFFF_FFFF_FFFF)
        return gen


def pack_pieces(counts: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Sequence ``i``'s ``counts[i]`` tokens as ``(i, offset, count)`` pieces,
    in order, packed into forwards of at most ``budget`` tokens (a sequence
    longer than the room left is split, like a chunked prefill)."""
    forwards: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = budget
    for i, n in enumerate(counts):
        done = 0
        while done < n:
            take = min(n - done, room)
            current.append((i, done, take))
            done += take
            room -= take
            if room == 0:
                forwards.append(current)
                current, room = [], budget
    if current:
        forwards.append(current)
    return forwards
