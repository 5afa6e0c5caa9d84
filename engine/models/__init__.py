"""Model definitions and loading.

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
(one decoder class; their differences are read from config.json).
"""

from __future__ import annotations

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArchConfig"]
