"""A node's LoRA adapters by name: what it publishes (NodeInfo.lora_adapters)
and the LoRARequest a DecodeRequest's or PrefillRequest's ``lora`` names.

Both nodes of a disaggregated request resolve the same reference; the digest
in it is the one the router read from the registry, so a node whose adapter
of that name holds other weights refuses rather than compute (or receive) KV
the other node would not (docs/routing.md, "LoRA adapters").

Loading and unloading at run time (NodeControl's LoadLoRA / UnloadLoRA) is
common/runtime/node_lora_control.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class AdapterRefused(Exception):
    """A request's adapter this node cannot apply, with the status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class NodeAdapters:
    """name -> (the adapter's LoRARequest, the digest of its files)."""

    by_name: dict[str, tuple[LoRARequest, str]] = field(default_factory=dict)
    # The lora_int_id the next load takes: ids are never reused, so an id
    # always means the same files to the engine (engine/lora/manager.py).
    next_id: int = 1

    def add(self, request: LoRARequest, digest: str) -> None:
        self.by_name[request.lora_name] = (request, digest)
        self.next_id = max(self.next_id, request.lora_int_id + 1)

    def digests(self) -> dict[str, str]:
        return {name: digest for name, (_, digest) in self.by_name.items()}

    def resident(self, engine: LLMEngine) -> list[str]:
        """The names of the adapters in the engine's device slots now (any
        thread: a copy of the slots' map, then names by id)."""
        slots = engine.model_runner.lora_slots
        if slots is None:
            return []
        ids = set(slots.resident)
        return [name for name, (r, _) in self.by_name.items() if r.lora_int_id in ids]

    def request_of(self, ref, node_id: str) -> LoRARequest | None:
        """The LoRARequest of ``ref`` (a LoRAAdapterRef; None: the base model).
        AdapterRefused: NOT_FOUND for a name this node lacks, FAILED_PRECONDITION
        for one whose digest differs from the router's."""
        if not ref.name:
            return None
        known = self.by_name.get(ref.name)
        if known is None:
            raise AdapterRefused(
                grpc.StatusCode.NOT_FOUND,
                f"node {node_id} has no LoRA adapter {ref.name!r} (has: {sorted(self.by_name)})",
            )
        request, digest = known
        if ref.digest and ref.digest != digest:
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id}'s LoRA adapter {ref.name!r} has digest {digest}, "
                f"not {ref.digest}: it was loaded from other files",
            )
        return request
