"""``LoRARequest``: a request's adapter, as vLLM's ``LLM.generate(..., lora_request=...)``
takes it. Torch-free (the scheduler and the router read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """``lora_name``: the adapter's public name; ``lora_int_id``: a positive id,
    unique per adapter in this engine (its key in the slot and host caches);
    ``lora_path``: a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be a positive integer; got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path of adapter {self.lora_name!r} must name a PEFT adapter directory"
            )

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id
