"""Which model a request names: the served base model or a LoRA adapter that
nodes registered (NodeInfo.lora_adapters), and what an adapter adds to the
request's identity (the block-hash extra key, docs/architecture.md "Block hashes").

Pure functions over the registry: the router's routing read keeps the map of
adapters current (router/routing.py); nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.cluster.state import NodeInfo, lora_adapters_of
from engine.block_hash import ExtraKeys, lora_extra_key


class ModelNotFound(LookupError):
    """The request names a model this cluster does not serve (NOT_FOUND, 404 model_not_found)."""


@dataclass(slots=True, frozen=True)
class ModelChoice:
    """The model a request runs: the base (empty name) or one adapter, by name
    and the digest of its files as the registry has it."""

    lora_name: str = ""
    lora_digest: str = ""

    @property
    def extra_keys(self) -> ExtraKeys:
        """The block-hash extra keys of the request's KV (none for the base model)."""
        return (lora_extra_key(self.lora_digest),) if self.lora_name else ()


BASE_MODEL = ModelChoice()


def served_adapters(nodes: Iterable[NodeInfo], model_id: str) -> dict[str, str]:
    """Adapter name -> digest over the live nodes serving ``model_id``. Where
    nodes disagree on a name's files, the digest most nodes hold wins (ties:
    the smallest), and only nodes holding it get that adapter's requests."""
    votes: dict[str, Counter] = {}
    for node in nodes:
        if node.model_id != model_id:
            continue
        for name, digest in lora_adapters_of(node).items():
            votes.setdefault(name, Counter())[digest] += 1
    return {
        name: min(counts, key=lambda d: (-counts[d], d)) for name, counts in sorted(votes.items())
    }


def resolve_model(model: str, base_model: str, adapters: Mapping[str, str]) -> ModelChoice:
    """The request's ``model`` (empty: the base); ModelNotFound naming it and what is served."""
    if not model or model == base_model:
        return BASE_MODEL
    digest = adapters.get(model)
    if digest is None:
        served = ", ".join(repr(m) for m in [base_model, *adapters])
        raise ModelNotFound(f"the model {model!r} does not exist (this server serves {served})")
    return ModelChoice(model, digest)


def holds_adapter(node: NodeInfo, choice: ModelChoice) -> bool:
    """Whether ``node`` can run a request under ``choice`` (any node runs the base)."""
    if not choice.lora_name:
        return True
    return lora_adapters_of(node).get(choice.lora_name) == choice.lora_digest
