"""Piecewise CUDA graphs for mixed steps (engine/piecewise_graphs.py) against eager steps.

Run on a GPU host: ``python -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.shapes import write_shape_dir

pytestmark = pytest.mark.gpu

RNG = random.Random(0)
PROMPTS = [[RNG.randrange(1, 10000) for _ in range(n)] for n in (5, 17, 40, 130, 300, 33, 71, 9)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_shape_dir("smollm2-135m", str(tmp_path_factory.mktemp("shape")))


@pytest.mark.parametrize("fused_ops", [True, False])
@torch.inference_mode()
def test_mixed_step_matches_eager_and_padding_writes_no_kv(model_dir, fused_ops):
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        attention_backend="triton",
        fused_ops=fused_ops,
        max_model_len=1024,
        num_kvcache_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        piecewise_cuda_graphs=True,
    )
    runner = ModelRunner(config, frozenset())
    pw = runner.piecewise
    assert pw is not None and pw.sizes[-1] == 256 and 48 in pw.sizes
    gen = torch.Generator().manual_seed(4)
    lens = [5, 40, 300]
    prompts = [torch.randint(0, 40000, (n + 1,), generator=gen).tolist() for n in lens]
    new = torch.randint(0, 40000, (37,), generator=gen).tolist()
    tables, next_block = [], 0
    for p in [*prompts, new]:
        n = -(-len(p) // runner.block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    prefill = runner.build_inputs([p[:-1] for p in prompts], [0] * 3, lens, tables[:3])
    runner.model(prefill.input_ids, prefill.positions, prefill.meta)
    # 3 decodes then a 37-token prompt: 40 tokens, replayed on the 48-token graphs.
    mixed = runner.build_inputs([*prompts, new], [*lens, 0], [1, 1, 1, 37], tables)
    assert pw.can_run(mixed) and not runner.graphs.can_run(mixed)
    before = runner.kv_cache.clone()
    graph_hidden = pw.run(mixed).clone()
    torch.cuda.synchronize()
    # Only the step's own slots were written (the 8 padding rows have slot -1).
    changed = (runner.kv_cache != before).any(-1).any(-1).any(0).any(0).flatten()
    written = set(changed.nonzero().flatten().tolist())
    assert written and written <= set(mixed.meta.slot_mapping.tolist())
    after_graph = runner.kv_cache.clone()
    eager_hidden = runner.model(mixed.input_ids, mixed.positions, mixed.meta)
    err = (graph_hidden.float() - eager_hidden.float()).abs().max().item()
    assert err < 2e-2 * eager_hidden.float().abs().max().item(), err
    kv_err = (runner.kv_cache.float() - after_graph.float()).abs().max().item()
    assert kv_err < 2e-2 * after_graph.float().abs().max().item(), kv_err
    # A larger step than the largest graph: not for the piecewise path.
    big = runner.build_inputs([list(range(300))], [0], [300], [list(range(19))])
    assert not pw.can_run(big)


def run_greedy(model_dir, piecewise: bool, **kw):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        num_kvcache_blocks=512,
        piecewise_cuda_graphs=piecewise,
        **kw,
    )
    runner = llm.llm_engine.model_runner
    calls = [0]
    if piecewise:
        assert runner.piecewise is not None
        inner = runner.piecewise.run

        def counted(inputs, after_layer=None):
            calls[0] += 1
            return inner(inputs, after_layer)

        runner.piecewise.run = counted
    else:
        assert runner.piecewise is None
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    if piecewise:
        del runner.piecewise.run  # the counting wrapper refers back to the graphs
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, calls[0]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_outputs_equal_with_and_without_piecewise_graphs(model_dir, async_scheduling):
    """A small token budget and few sequences at a time: prompts arrive (and are
    chunked) while others decode, so most steps are mixed."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    ref, _ = run_greedy(model_dir, False, **kw)
    ours, calls = run_greedy(model_dir, True, **kw)
    assert calls > 10
    assert ours == ref


@torch.inference_mode()
def test_a_streamed_prefill_keeps_its_piecewise_graphs_and_sees_each_layer_written(model_dir):
    """A prefill node's KV observer (engine/kv_writes.py) no longer forces eager
    steps: a step of up to 512 tokens replays its pieces and the hook runs after
    the piece that ends each layer, in order, once per layer, with that layer's
    KV already written (what the hook queues on the stream sees it)."""
    from engine.kv_blocks import gather_blocks
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cuda",
            attention_backend="triton",
            max_model_len=1024,
            num_kvcache_blocks=256,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            piecewise_cuda_graphs=True,
            async_scheduling=False,
        )
    )
    runner = engine.model_runner
    assert runner.piecewise is not None
    replays = []
    real_run = runner.piecewise.run
    runner.piecewise.run = lambda inputs, after_layer=None: (
        replays.append(after_layer is not None) or real_run(inputs, after_layer)
    )
    seen: list[tuple[int, torch.Tensor]] = []
    ahead: dict[int, torch.Tensor] = {}  # at hook(i), layer i + 2 (its piece not yet run)
    blocks: list[int] = []
    num_layers = runner.kv_cache.shape[1]

    def hook(i: int) -> None:
        seen.append((i, gather_blocks(runner.kv_cache, blocks, (i, i + 1))))
        if i + 2 < num_layers:
            ahead[i + 2] = gather_blocks(runner.kv_cache, blocks, (i + 2, i + 3))

    class Observer:
        def begin_step(self, batch):
            blocks[:] = batch.seqs[0].block_table
            return hook

        def step_sampled(self, token_ids, rows):
            pass  # this test reads the KV, not the samples

    engine.observe_kv_writes(Observer())
    prompt = [RNG.randrange(1, 10000) for _ in range(300)]
    # hold_kv: the blocks stay the request's after it finishes, as on a prefill node.
    engine.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), hold_kv=True
    )
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    assert replays and replays[0] is True  # the prefill step replayed pieces, hook attached
    assert [i for i, _ in seen] == list(range(num_layers))
    assert engine.take_held("r") is not None and len(blocks) == -(-300 // runner.block_size)
    for i, snapshot in seen:
        # What the hook's gather read equals the layer's final KV: it was written.
        torch.testing.assert_close(snapshot, gather_blocks(runner.kv_cache, blocks, (i, i + 1)))
        assert snapshot.abs().sum() > 0
    # Hook by hook, not all at the end: two layers on, the KV was not written yet.
    for layer, early in ahead.items():
        assert not torch.equal(early, gather_blocks(runner.kv_cache, blocks, (layer, layer + 1)))
    engine.release_held("r")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
