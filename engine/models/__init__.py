"""Model definitions and loading.

Supported architectures: engine/models/families.py's FAMILIES (Llama, Mistral,
Qwen2, Qwen3, Gemma3 text, Mixtral, Qwen2-MoE, Qwen3-MoE), one decoder class;
their differences are read from config.json.
"""

from __future__ import annotations

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArchConfig"]
