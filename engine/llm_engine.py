"""LLMEngine: the step-level API that the offline LLM and both node kinds drive.

Life cycle of a request inside the engine:

1. ``add_request`` checks the prompt and parameters (InputProcessor; a bad
   request raises ValueError and leaves no state behind), then creates one
   Sequence per completion (``n``) and queues them WAITING.
2. Each ``step``: the Scheduler picks (sequence, new tokens) pairs — decodes
   first, then chunks of prefills starting past their verified prefix-cache
   hit — and claims KV blocks, preempting by recompute if the pool is full.
   With a host tier (``swap_space``) the step's copies between the tiers
   (spilled evictions, prefix hits there, swaps) are issued as one batch
   before the forward; a sequence loading from the host joins a later step
   once its copies landed (engine/tier_copies.py).
3. The ModelRunner writes the new tokens' KV into their blocks, runs the model
   and samples for sequences whose last uncomputed token was in the step.
4. The Scheduler advances ``num_computed_tokens`` and registers newly full
   blocks in the prefix cache; the OutputProcessor attaches logprobs,
   detokenizes, applies stop conditions and frees finished sequences' blocks.
5. ``step`` returns a RequestOutput for each request with news, per its
   ``output_kind``; finished requests are forgotten.

``abort_request`` frees a request's blocks immediately; its final output
(finish_reason "abort") comes from ``take_outputs`` (the next ``step``'s first).
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass
from functools import partial

from engine.async_step import InFlightStep, StepLog
from engine.block_hash import (
    MAX_CACHED_HASHERS,
    ExtraKeys,
    HasherCache,
    lora_extra_key,
    numerics_extra_keys,
)
from engine.block_manager import BlockManager, CacheEvents
from engine.config import EngineConfig
from engine.detokenizer import TokenizerInfo
from engine.engine_stats import EngineStats, collect_stats
from engine.host_tier import HostTier
from engine.input_processor import InputProcessor, PromptType
from engine.kv_cache_dtype import storage_name
from engine.kv_writes import KVWriteObserver
from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.parallel.handoff import Call
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import (
    PLACEHOLDER,
    FinishReason,
    Request,
    Sequence,
    SequenceStatus,
    TokenLogprobs,
)
from engine.spec_decode.speculator import Speculator
from engine.step_clock import StepClock, StepKind
from engine.structured.scheduling import StructuredOutputs
from engine.tier_copies import TierTransfers
from engine.tokenizer import load_tokenizer
from engine.tp_workers import TPWorkers

__all__ = ["MAX_CACHED_HASHERS", "LLMEngine", "Reservation"]


@dataclass(slots=True)
class Reservation:
    """Blocks a decode node holds for a prompt that a prefill node computes."""

    request_id: str
    block_ids: list[int]  # the prompt's whole block table
    # Blocks before this came from this node's own prefix cache (its device
    # pool, then its host tier: copied in by the time the reservation returns).
    first_block: int
    num_prompt_tokens: int

    @property
    def blocks_to_fill(self) -> list[int]:
        return self.block_ids[self.first_block :]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer)
        tok_info = TokenizerInfo.from_tokenizer(self.tokenizer) if self.tokenizer else None
        eos = set(config.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._start_model(config)
        self.host_tier = self._host_tier(config)
        self.block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
            host_tier=self.host_tier,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            sliding_window=config.model_config.freeing_window,
            preemption_mode=config.preemption_mode,
            lora_slots=self.model_runner.lora_slots,
        )
        self.input_processor = InputProcessor(config, self.tokenizer, self.eos_token_ids, tok_info)
        on_cuda = self.model_runner.device.type == "cuda"
        # Grammars, matchers and bitmasks (engine/structured/).
        self.structured = StructuredOutputs(config, self.tokenizer, self.eos_token_ids, on_cuda)
        self.output_processor = OutputProcessor(
            self.scheduler,
            self.model_runner,
            tok_info,
            self.eos_token_ids,
            config.max_model_len,
            self.structured,
        )
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.num_computed_tokens = 0  # since start (EngineStats)
        self.num_generated_tokens = 0
        self._touched: set[str] = set()
        # Block hashers per tenant salt (None: no prefix caching, nothing to hash).
        hashers = HasherCache(config.served_model_name, config.kvcache_block_size)
        self._hashers = hashers if config.enable_prefix_caching else None
        # The block identity every request of this engine shares beyond the
        # model: its weight quantization and an FP8 cache's numbers (the mapping
        # routers apply to each node's registration too).
        quantization = config.quantization.value if config.quantization else None
        stored = storage_name(config.kv_cache_dtype, self.model_dtype_name)
        self.numerics_keys: ExtraKeys = numerics_extra_keys(quantization, stored)
        # Their sampling reads output ids on the host: a step for one waits for the last.
        self._reads_output: set[str] = set()
        # Async scheduling: the launched step whose samples the host has not read.
        self._in_flight: InFlightStep | None = None
        # Scheduler.num_changes when a step found it must wait for room (``_idle_step``).
        self._room_wait: int | None = None
        self._plan_steps(config, on_cuda)
        self.step_log = StepLog()  # tokens and the device's wait for host work, per step

    def _plan_steps(self, config: EngineConfig, on_cuda: bool) -> None:
        """Async scheduling, speculation and late launch, as configured."""
        asked = config.async_scheduling
        # Speculation plans each step from the last one's accepted tokens:
        # synchronous steps (EngineConfig refuses async_scheduling=True with it).
        spec = config.speculative_config
        draft = self.model_runner.draft.propose if self.model_runner.draft is not None else None
        self.async_scheduling = on_cuda and spec is None if asked is None else asked
        self.speculator = (
            Speculator(
                spec, config.max_model_len, self.block_manager, draft, self.structured.valid_prefix
            )
            if spec is not None
            else None
        )
        # Late launch: when to build the next step (None: as soon as possible).
        self.step_clock = StepClock() if self.async_scheduling and config.late_launch else None

    def _start_model(self, config: EngineConfig) -> None:
        """The model runner, and with tensor parallelism ranks 1..t-1 in their own
        processes, following this runner's steps (engine/tp_workers.py)."""
        self.tp_workers = (
            TPWorkers(config, self.eos_token_ids) if config.tensor_parallel_size > 1 else None
        )
        try:
            self.model_runner = ModelRunner(
                config, self.eos_token_ids, self.tp_workers.group if self.tp_workers else None
            )
        except Exception as e:
            self._raise_if_a_rank_died(e)
            raise
        if self.tp_workers is not None:
            # The followers stop with this engine (gc, interpreter exit, or shutdown()).
            self._stop_workers = weakref.finalize(self, self.tp_workers.close)

    def _host_tier(self, config: EngineConfig) -> HostTier | None:
        """The host tier's slots and the copies into and out of them (None: off)."""
        self.tier_transfers: TierTransfers | None = None
        copier = self.model_runner.tier_copier
        if copier is None:
            return None
        tier = HostTier(copier.num_slots)
        # With tensor parallelism every other rank issues the same batches.
        handoff = self.model_runner.handoff
        send = handoff.send_tier if handoff is not None else None
        self.tier_transfers = TierTransfers(tier, copier, send)
        return tier

    def _flush_tiers(self, wait: bool = False) -> None:
        """Issue the copies scheduling queued (before anything can write the
        blocks they read); ``wait``: until they are done (a KV transfer writes
        reserved blocks on a stream of its own)."""
        if self.tier_transfers is None:
            return
        loads = self.scheduler.take_new_loads()
        self._stamp_first_scheduled(loads)
        self.tier_transfers.flush(loads, wait)
        if wait:
            self._poll_tiers(wait=True)

    def _poll_tiers(self, wait: bool = False) -> None:
        """Sequences whose copies from the host landed join the running batch."""
        if self.tier_transfers is not None and self.tier_transfers.busy:
            loaded = self.tier_transfers.poll(wait)
            if loaded:
                self.scheduler.loads_done(loaded)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        hold_kv: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. ``hold_kv`` (prefill node): keep its blocks when it
        finishes, until ``release_held``. ``lora_request``: its adapter (an
        engine with ``enable_lora``)."""
        req = self._new_request(request_id, prompt, params, arrival_time, lora_request)
        for seq in req.seqs:
            seq.hold_kv = hold_kv
        self.requests[request_id] = req
        if req.params.reads_output_ids:
            self._reads_output.add(request_id)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.structured.add(req)  # its sequences wait for their grammar

    def reserve_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Reservation | None:
        """Decode node: claim KV blocks for a prompt that a prefill node will compute.

        Uses this node's own prefix cache first, both tiers (host-tier hits are
        copied in before this returns), so the prefill node only sends blocks
        from ``first_block`` on. Returns None, changing nothing, when the
        node lacks blocks or sequence slots. The request is not scheduled until
        ``commit_request``; ``abort_request`` frees its blocks.
        """
        req = self._new_request(request_id, prompt, params, arrival_time, lora_request)
        if req.params.n != 1:
            raise ValueError("a request prefilled remotely must have n = 1")
        if req.params.prompt_logprobs is not None:
            raise ValueError("a request prefilled remotely cannot ask for prompt_logprobs")
        seq = req.seqs[0]
        reserved = self.scheduler.reserve(seq)
        # Its host-tier hits are copied in, and blocks it evicted spill, before
        # the KV lands (a transfer writes the blocks on a stream of its own).
        self._flush_tiers(wait=True)
        if not reserved:
            return None
        self.requests[request_id] = req
        if req.params.reads_output_ids:
            self._reads_output.add(request_id)
        self.structured.add(req)  # compiles while the prompt is prefilled elsewhere
        bs = self.config.kvcache_block_size
        return Reservation(
            request_id=request_id,
            block_ids=list(seq.block_table),
            first_block=seq.num_computed_tokens // bs,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def commit_request(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Decode node: the reserved prompt's KV has landed and the prefill node
        sampled ``first_token``; the request joins the running batch (its first
        output comes from ``take_outputs``). A structured request's matcher
        accepts ``first_token`` (when its grammar is still compiling, it replays
        it on start) before the request's first step here."""
        req = self.requests.get(request_id)
        if req is None or req.seqs[0].status is not SequenceStatus.RESERVED:
            raise KeyError(f"request {request_id!r} has no reservation")
        seq = req.seqs[0]
        self.scheduler.commit(seq)
        seq.num_cached_tokens = cached_tokens  # what the prefill node served from its cache
        seq.token_ids.append(first_token)
        # It joins the running batch now (it never passes through the waiting
        # queue, where step() stamps first_scheduled_time).
        req.first_token_time = req.first_scheduled_time = time.monotonic()
        self.output_processor.accept_token(req, seq, first_token, first_logprobs)
        self._touched.add(request_id)

    def take_held(self, request_id: str) -> Sequence | None:
        """Prefill node: a finished request whose blocks are held for its transfer."""
        return self.scheduler.held.get(request_id)

    def release_held(self, request_id: str) -> None:
        seq = self.scheduler.held.get(request_id)
        if seq is not None:
            self.scheduler.release_held(seq)
            self.model_runner.release(seq)

    def _new_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        if isinstance(request_id, str) and (
            request_id in self.requests or request_id in self.scheduler.held
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        extra_keys = self.numerics_keys + self._lora_keys(lora_request)
        return self.input_processor.new_request(
            request_id, prompt, params, arrival_time, self._hashers, lora_request, extra_keys
        )

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Read and check an adapter now (vLLM's name), not at its first request.
        ``adapter``: what ``model_runner.lora.read(lora_request)`` gave on
        another thread, so that a serving engine's thread does no disk IO."""
        self._lora_keys(lora_request, adapter)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's name); False if the engine does not know it.

        Requests already queued or running under it finish on its weights
        (drain): its host copy and device slot are freed when the last one
        leaves. A request that names it afterwards reads it again, as one
        naming any new adapter does. Its KV stays in the prefix cache, keyed by
        the adapter's digest: only the same files, loaded again, can hit it,
        and the LRU evicts it like any other block."""
        lora = self.model_runner.lora
        if lora is None or not lora.remove(lora_int_id):
            return False
        self._release_removed_loras()
        return True

    def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every adapter requests may name now (read and not removed)."""
        lora = self.model_runner.lora
        return set(lora.known) if lora is not None else set()

    def lora_requests_in_flight(self, lora_int_id: int) -> int:
        """Requests of this engine (queued, reserved or running) under an adapter."""
        return sum(1 for req in self.requests.values() if _lora_id(req) == lora_int_id)

    def _release_removed_loras(self) -> None:
        """Free the removed adapters that no request uses any more."""
        lora = self.model_runner.lora
        if lora is None or not lora.removing:
            return
        slots = self.scheduler.lora_slots
        # A sequence holds its slot only while its request is here; the slot
        # check is a guard, never a step's failure.
        in_use = {_lora_id(req) for req in self.requests.values()}
        in_use.update(i for i in lora.removing if slots.users(i))
        for lora_int_id in lora.removing - in_use:
            lora.release(lora_int_id, slots)

    def _lora_keys(
        self, lora_request: LoRARequest | None, adapter: LoRAAdapter | None = None
    ) -> ExtraKeys:
        """The block-hash extra keys of a request's adapter, checked (and read
        from disk on first sight); () for the base model."""
        if lora_request is None:
            return ()
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest; got {type(lora_request).__name__}"
            )
        if self.model_runner.lora is None:
            raise ValueError(
                f"request names LoRA adapter {lora_request.lora_name!r} but the engine was "
                "started without enable_lora=True"
            )
        return (lora_extra_key(self.model_runner.lora.register(lora_request, adapter)),)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Free the requests' KV blocks now (reserved and held ones too); unknown
        or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.release_held(request_id)
            self._touched.discard(request_id)
            req = self.requests.pop(request_id, None)
            self._reads_output.discard(request_id)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()  # its token was never read: not part of the output
                self.scheduler.abort([seq])
                self.model_runner.release(seq)
                self.structured.release(seq)
            req.aborted = True
            req.finished_time = time.monotonic()
            self._aborted.append(req)
        self._release_removed_loras()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted)

    def has_work(self) -> bool:
        """Whether ``step`` would do anything (reserved requests wait for their
        KV; so do requests that need the room reservations hold)."""
        return bool(
            self._aborted
            or self._touched
            or self._in_flight is not None
            or (self.scheduler.has_unfinished() and not self._waiting_for_room())
            or self._copies_in_flight()
        )

    def _waiting_for_room(self) -> bool:
        """What is pending needs room that reservations or held blocks hold,
        and nothing changed since a step found so (``Scheduler.waits_for_room``)."""
        return self._room_wait == self.scheduler.num_changes

    def _copies_in_flight(self) -> bool:
        return self.tier_transfers is not None and self.tier_transfers.busy

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------- step
    def take_outputs(self) -> list[RequestOutput]:
        """Outputs of requests changed between steps (aborted; committed remote
        prefills' first tokens): a ``step``'s first, or an engine thread's at once."""
        outputs = [out for req in self._aborted if (out := self.output_processor.make_output(req))]
        self._aborted.clear()
        for request_id in self._touched:
            outputs.extend(self._output_for(request_id))
        self._touched.clear()
        return outputs

    def step(self) -> list[RequestOutput]:
        self._poll_tiers()
        self._fail_grammars()  # and start the matchers of compiled ones
        outputs = self.take_outputs()  # now, not after another forward pass
        prev, self._in_flight = self._in_flight, None
        if outputs or not (self.scheduler.has_unfinished() or prev) or self._waiting_for_room():
            self._in_flight = prev
            return outputs
        began = time.monotonic()
        try:
            batch = self._schedule()  # a draft model's forwards run on every rank
        except Exception as e:
            self._raise_if_a_rank_died(e)
            raise
        scheduled_s = time.monotonic() - began
        # Penalties and bad words read the output ids on the host: such a step waits for the last.
        if prev is not None and (
            not batch.seqs
            or (self._reads_output and any(s.params.reads_output_ids for s in batch.seqs))
        ):
            outputs.extend(self._finish_step(prev))
            if not batch.seqs:
                return outputs  # the next step schedules what this one's tokens allow
            prev = None
        if not batch.seqs:
            return self._idle_step(batch, outputs)
        self._room_wait = None
        # The launch's host time leaves out a wait for `prev` above (penalties).
        began = time.monotonic() - scheduled_s
        try:
            # A structured row whose grammar needs prev's token reads prev first.
            step, read = self.structured.launch(
                self.model_runner, batch, prev, self.async_scheduling, self._finish_step
            )
        except Exception as e:
            self._raise_if_a_rank_died(e)
            raise
        self.num_computed_tokens += batch.num_tokens
        if self.step_clock is not None:
            kind = StepKind.of(batch.num_tokens, len(batch.seqs))
            self.step_clock.launched(kind, began, time.monotonic(), prev is None or prev.done())
        # The device runs `step` while the host reads and processes `prev`.
        if read is not None:
            outputs.extend(read)
        elif prev is not None:
            outputs.extend(self._finish_step(prev))
        step.add_placeholders(self.scheduler.advance(batch))
        if self.async_scheduling:
            self._in_flight = step
        else:
            outputs.extend(self._finish_step(step))
        return outputs

    def _idle_step(
        self, batch: ScheduledBatch, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """A step that scheduled nothing and has nothing in flight: wait for
        what can end it, or fail where nothing can."""
        # Loads, or swap-outs a swapped sequence must see land before it resumes.
        if self.scheduler.loading or self._copies_in_flight():
            self._poll_tiers(wait=True)
            return outputs
        if batch.preempted or self.structured.idle_wait():
            return outputs  # memory was reclaimed, or grammars compile
        if self.scheduler.waits_for_room():
            # Reservations land or end (commit, abort: a lease ran out), held
            # blocks are released: commands, not steps. Until the scheduler
            # changes another step would find the same, so none runs
            # (``has_work`` is False: the engine thread blocks on its commands).
            self._room_wait = self.scheduler.num_changes
            return outputs
        sched, bm = self.scheduler, self.block_manager
        raise RuntimeError(
            "the scheduler could not schedule any pending sequence "
            f"({len(sched.waiting)} waiting, {len(sched.swapped)} swapped, "
            f"{len(sched.running)} running; {bm.num_free_blocks} of {bm.num_blocks} blocks free)"
        )

    def _schedule(self) -> ScheduledBatch:
        """The next step's batch (with proposals to verify, and the host tier's
        copies issued); the admitted requests' first scheduling time."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else ScheduledBatch()
        self._flush_tiers()
        if self.speculator is not None:
            self.speculator.drop_unscheduled(self.scheduler.running, batch.seqs)
        self._stamp_first_scheduled(batch.admitted)
        return batch

    def _stamp_first_scheduled(self, seqs: list[Sequence]) -> None:
        """Their requests' first_scheduled_time, where not set yet: admitted to
        a step, or loading their prefix from the host tier."""
        now = time.monotonic()
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now

    def launch_delay(self) -> float:
        """Seconds the next ``step`` should wait for the step in flight to near its
        end, so requests added meanwhile join it (engine/step_clock.py); 0: now."""
        if self.step_clock is None or self._aborted or self._touched:
            return 0.0
        if (prev := self._in_flight) is None or prev.done():
            return 0.0
        prompt_rows = bool(self.scheduler.waiting) or prev.batch.num_tokens > len(prev.batch.seqs)
        return self.step_clock.wait(time.monotonic(), prompt_rows)

    def _fail_grammars(self) -> None:
        """End the requests whose grammar failed to compile (or in time): finish
        reason "abort", the reason in their output's ``error``."""
        for seq, error in self.structured.poll():
            req = self.requests.get(seq.request_id)
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.model_runner.release(seq)
            self.structured.release(seq)
            if req is not None:
                req.error = error
                if req.finished and req.finished_time is None:
                    req.finished_time = time.monotonic()
                self._touched.add(seq.request_id)

    @property
    def model_dtype_name(self) -> str:
        """What the model computes in, by name (``bfloat16``...): what a cache in
        the model's dtype stores (engine/kv_cache_dtype.py ``storage_name``)."""
        return str(self.model_runner.dtype).removeprefix("torch.")

    @property
    def num_grammar_matchers(self) -> int:
        """Sequences holding grammar state (compiling or matching): 0 at idle."""
        return self.structured.num_matchers

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (a no-op without them); the engine is
        unusable after."""
        if self.tp_workers is not None:
            self.tp_workers.close()

    def _finish_step(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's samples, fill its placeholders, process outputs."""
        was_done = step.done()
        host = step.read()
        self.step_log.observe(step)
        if self.step_clock is not None:
            self.step_clock.read(step.device_seconds(), time.monotonic(), was_done)
        requests = self.requests
        op = self.output_processor
        news: dict[str, Request] = {}  # requests with something to report, in batch order
        if step.prompt_logprobs is not None:
            for seq, entries in zip(step.batch.seqs, step.prompt_logprobs, strict=True):
                req = requests.get(seq.request_id)
                if entries and req is not None:
                    op.add_prompt_logprobs(req, entries)
        if host is not None:
            now = time.monotonic()
            token_ids, logprobs = host.token_ids, host.logprobs
            finished = SequenceStatus.FINISHED
            final_only = RequestOutputKind.FINAL_ONLY
            generated = 0
            for seq, j, pos in step.placeholders:
                if seq.status is finished:
                    continue  # a dropped extra-step token: never appended or counted
                token = token_ids[j]
                seq.token_ids[pos] = token
                generated += 1
                req = requests.get(seq.request_id)
                if req is None:
                    continue
                if req.first_token_time is None:
                    req.first_token_time = now
                drafts, seq.spec_token_ids = seq.spec_token_ids, []
                op.accept_token(req, seq, token, logprobs[j], now)
                if drafts:
                    emit = partial(op.accept_token, req, now=now)
                    generated += self.speculator.accept(seq, drafts, token_ids, logprobs, j, emit)
                # A FINAL_ONLY request (LLM.generate) has nothing to say until it ends.
                if req.params.output_kind is not final_only or (
                    seq.status is finished and req.finished
                ):
                    news[seq.request_id] = req
            self.num_generated_tokens += generated
            if step.verify is not None:
                self.model_runner.settle_generators(step.verify)
        outputs: list[RequestOutput] = []
        for request_id in news:
            outputs.extend(self._output_for(request_id))
        return outputs

    def _output_for(self, request_id: str) -> list[RequestOutput]:
        req = self.requests[request_id]
        out = self.output_processor.make_output(req)
        if out.finished if out is not None else req.finished:
            del self.requests[request_id]
            self._reads_output.discard(request_id)
            if req.seqs[0].lora_request is not None:
                self._release_removed_loras()
        return [out] if out is not None else []

    # --------------------------------------------------------------- misc
    def reset_prefix_cache(self) -> int:
        """Evict the cached blocks no request holds; returns how many."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        # Every rank copies its heads of each block: the bytes of all of them.
        block_bytes = 0
        if self.tier_transfers is not None:
            block_bytes = self.tier_transfers.copier.block_bytes * self.config.tensor_parallel_size
        stats = collect_stats(
            self.scheduler,
            self.block_manager,
            self.num_computed_tokens,
            self.num_generated_tokens,
            block_bytes,
            self.speculator.stats.copy() if self.speculator is not None else None,
            self.structured.stats(),
        )
        offload = self.model_runner.offload
        stats.offloaded_weight_bytes = offload.offloaded_bytes if offload is not None else 0
        return stats

    # ------------------------------------------------------- for the nodes
    def _raise_if_a_rank_died(self, error: Exception) -> None:
        if self.tp_workers is not None:
            self.tp_workers.raise_if_dead(error)

    def queue_room(self) -> tuple[int, int]:
        """(requests waiting, free sequence slots): what a node's queue bound needs."""
        return len(self.scheduler.waiting), self.scheduler.num_free_slots

    def observe_kv_writes(self, observer: KVWriteObserver | None) -> None:
        """Prefill node: be told when each layer's KV is written (None: stop).
        With tensor parallelism this is rank 0's; the others install their own
        through their worker extension."""
        self.model_runner.kv_observer = observer

    def call_workers(self, method: str, payload: dict) -> None:
        """``method(payload)`` on the worker extension of every rank but this one
        (``worker_extension_cls``), before the next step; a no-op without tensor
        parallelism. Engine thread only. ``payload`` travels as JSON."""
        if self.tp_workers is None:
            return
        if not self.config.worker_extension_cls:
            raise ValueError("call_workers needs worker_extension_cls in the engine's config")
        call = Call(method, json.dumps(payload, separators=(",", ":")).encode())
        try:
            self.model_runner.handoff.call(call)
        except Exception as e:
            self._raise_if_a_rank_died(e)
            raise

    def num_held(self) -> int:
        """Prefill node: finished requests whose blocks wait for their transfer."""
        return len(self.scheduler.held)

    def enable_cache_events(self) -> None:
        """Record the block hashes the prefix cache stores and evicts (for Redis)."""
        self.block_manager.enable_events()

    def take_cache_events(self) -> CacheEvents:
        """The prefix cache's changes since the last take."""
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> CacheEvents:
        """Every block hash the prefix cache and the host tier hold now, as
        stored events; the events so far are superseded by this snapshot (a
        node republishing after a Redis outage)."""
        return self.block_manager.cached_snapshot()


def _lora_id(req: Request) -> int:
    """The ``lora_int_id`` a request runs under (0: the base model)."""
    lora = req.seqs[0].lora_request
    return lora.lora_int_id if lora is not None else 0
