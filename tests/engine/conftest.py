"""Engine fixtures on the demo model (SmolLM2-135M-Instruct, fp32 on the CPU)."""

from __future__ import annotations

import pytest

# Varied prompts: chat-templated and raw, short and long, multilingual, code.
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Les mathématiques sont",
    "1, 2, 3, 5, 8, 13,",
]
CHAT_QUESTIONS = [
    "What is the boiling point of water?",
    "Name three primary colors.",
    "Why is the sky blue? Answer briefly.",
]


@pytest.fixture(scope="session")
def parity_prompts(demo_tokenizer) -> list[list[int]]:
    chats = [
        demo_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in CHAT_QUESTIONS
    ]
    chats = [c["input_ids"] if isinstance(c, dict) or hasattr(c, "keys") else c for c in chats]
    return [demo_tokenizer.encode(p) for p in RAW_PROMPTS] + [list(c) for c in chats]


@pytest.fixture(scope="session")
def demo_llm(demo_model_dir):
    from engine import LLM

    return LLM(str(demo_model_dir), max_model_len=1024, device="cpu")


def assert_idle(llm) -> None:
    """At idle every block is free (possibly still cached) and the books balance."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def perturbed_copy(model_dir, out):
    """A copy of ``model_dir`` in ``out`` with noise on its MLPs: a draft model
    that mostly agrees with the original (fixed seed)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if "mlp" in name:
            t += 0.5 * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out
