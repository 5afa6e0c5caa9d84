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

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.sampling_params import StructuredOutputsParams
from engine.structured.validate import choice_grammar

logger = logging.getLogger(__name__)

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

    def submit(self, so: StructuredOutputsParams) -> Future:
        key = (self.tokenizer_key, so.key())
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
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
        compiler = self._xgr_compiler()
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
