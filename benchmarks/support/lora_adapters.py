"""Random PEFT LoRA adapters for a model directory's config, made with ``peft``.

The adapter files are PEFT's own (``LoraConfig`` + ``get_peft_model`` +
``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors``), so vLLM and pdserve read what a trained
adapter would give them. The base model is built on the meta device: only the
target modules' shapes matter, so a Llama-3.1-8B-shaped adapter needs none of
the base's 16 GB. The LoRA weights PEFT creates there are then materialized on
the CPU with ``nn.Linear``'s own initialization, which is what PEFT's
``init_lora_weights=False`` gives (B not zero: the adapter changes outputs).
"""

from __future__ import annotations

from pathlib import Path

# The seven projections of a Llama-style layer: what a rank-16 adapter of a
# served fine-tune typically trains, and what both engines apply.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapters(
    model_dir: Path, out_dir: Path, count: int, rank: int = 16, seed: int = 0
) -> list[Path]:
    """``count`` random adapters for the model in ``model_dir`` (its
    config.json), each in ``out_dir/lora-K``; different seeds, so different
    weights (and digests)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        # In the model's dtype, which the adapter keeps (autocast_adapter_dtype
        # off): what a fine-tune of it saves, half the bytes of float32 for bf16.
        base = AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(TARGET_MODULES),
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, lora_config, autocast_adapter_dtype=False)
    dirs = []
    for k in range(count):
        torch.manual_seed(seed * 100_003 + k)
        _materialize_lora_weights(model)
        path = Path(out_dir) / f"lora-{k}"
        model.save_pretrained(path)
        dirs.append(path)
    return dirs


def _materialize_lora_weights(model) -> None:
    """Give every LoRA A and B real CPU weights, initialized as ``nn.Linear``
    initializes its own (the base weights stay on the meta device)."""
    import torch
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (".lora_A." in name or ".lora_B." in name):
            module.to_empty(device="cpu")
            with torch.no_grad():
                module.reset_parameters()
