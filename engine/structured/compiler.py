"""Compiles structured-outputs specs on background threads, cached.

A compiled grammar (xgrammar's ``CompiledGrammar``: the spec's pushdown
automaton plus its token-mask cache for one tokenizer) is kept in an LRU keyed
by (tokenizer, spec); equal specs share one compile, even while it runs.
Compiles run on a small thread pool (xgrammar releases the GIL while it
compiles), so the engine thread never waits for one: a request waits in the
queue while its grammar compiles (engine/structured/manager.py).

xgrammar (and with it torch) is imported here, when the first structured
request arrives: ``import engine`` stays light.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutputsParams
from engine.structured.validate import choice_grammar

logger = logging.getLogger(__name__)

# Compile-time histogram bounds, seconds: a cached-shape regex (a millisecond)
# to a large schema on a busy CPU (the compile timeout's order).
COMPILE_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class GrammarStats:
    """What the compiler has done since start (a snapshot; plain data).
    ``buckets`` and ``sum`` read as a histogram's snapshot do
    (common/metrics/families.py): the compile times, cumulative per bound."""

    cache_hits: int = 0  # specs found in the cache (compiled, or compiling)
    cache_misses: int = 0  # compiles started
    # (upper bound, compiles that took at most that long); the last bound is +Inf.
    buckets: tuple[tuple[float, int], ...] = tuple(
        (bound, 0) for bound in (*COMPILE_SECONDS_BUCKETS, float("inf"))
    )
    sum: float = 0.0  # seconds, all compiles (failed ones too)
    num_matchers: int = 0  # sequences holding grammar state (the manager's; 0 at idle)


# The JSON schema of ``json_object``: any object (strict mode off, so that any
# property is allowed).
_ANY_OBJECT = '{"type": "object"}'


class GrammarCompiler:
    """One tokenizer's compiler: ``submit(spec)`` gives a Future of the compiled
    grammar (its exception: why it cannot compile)."""

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_key: str,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int,
        max_workers: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_key = tokenizer_key
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._backend: Any = None  # xgrammar's compiler, built on the pool at first use
        self._backend_lock = threading.Lock()
        self.num_compiles = 0  # compiles started (cache misses)
        self.num_cache_hits = 0
        # Compile times (every bound of COMPILE_SECONDS_BUCKETS, then +Inf) and their sum.
        self._compile_counts = [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)
        self._compile_sum = 0.0

    def submit(self, so: StructuredOutputsParams) -> Future:
        key = (self.tokenizer_key, so.key())
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, so)
            self.num_compiles += 1
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                # A running compile evicted here still completes for its requests.
                self._cache.popitem(last=False)
            return future

    def warm_up(self) -> Future:
        """Import xgrammar and index the tokenizer on the pool now, not at the
        first structured request."""
        return self._pool.submit(self._xgr_compiler)

    def cached(self, so: StructuredOutputsParams) -> bool:
        with self._lock:
            return (self.tokenizer_key, so.key()) in self._cache

    def stats(self, num_matchers: int = 0) -> GrammarStats:
        with self._lock:
            counts, total = list(self._compile_counts), self._compile_sum
            hits, misses = self.num_cache_hits, self.num_compiles
        cumulative, running = [], 0
        for bound, n in zip((*COMPILE_SECONDS_BUCKETS, float("inf")), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return GrammarStats(hits, misses, tuple(cumulative), total, num_matchers)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------ on the pool
    def _xgr_compiler(self) -> Any:
        with self._backend_lock:
            if self._backend is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # Our LRU is the cache; xgrammar's own would hold the same grammars twice.
                threads = max(1, min(8, (os.cpu_count() or 2) // 2))
                self._backend = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._backend

    def _compile(self, so: StructuredOutputsParams) -> Any:
        compiler = self._xgr_compiler()  # not timed: the tokenizer's index, once
        start = time.perf_counter()
        try:
            return self._compile_with(compiler, so)
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self._compile_counts[bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)] += 1
                self._compile_sum += seconds

    @staticmethod
    def _compile_with(compiler: Any, so: StructuredOutputsParams) -> Any:
        kind = so.kind
        try:
            if kind == "json":
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                return compiler.compile_json_schema(
                    schema, any_whitespace=not so.disable_any_whitespace
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    _ANY_OBJECT, any_whitespace=not so.disable_any_whitespace, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(so.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(so.choice))
            if kind == "grammar":
                return compiler.compile_grammar(so.grammar)
            return compiler.compile_structural_tag(so.structural_tag)
        except Exception as e:
            # xgrammar's messages start with a timestamp and a source position.
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {reason}") from None
