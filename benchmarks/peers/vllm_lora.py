"""vLLM's multi-LoRA as the peer of ``offline_throughput.py --loras``.

One ``vllm.LLM`` with the same LoRA options as pdserve's LoRA engine
(``enable_lora``, ``max_loras``, ``max_cpu_loras``, ``max_lora_rank``) and the
same engine settings as ``vllm_peer``'s, the same adapter files under
``LoRARequest(lora_name, lora_int_id, lora_path)``, the same rows in the same
order (benchmarks/offline_lora.py): every adapter registered
(``llm_engine.add_lora``) and probed first, ``reset_prefix_cache`` before
each row. Row 0 (no adapter, on this LoRA engine) is each row's base: the
plain vLLM engine is not run beside it, since a second engine in one process
would need the first one's GPU memory back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.offline_lora import PROBE_TOKENS, lora_engine_kwargs, mix, row
from benchmarks.peers.vllm_peer import VLLM_MISSING, engine_kwargs, workload


def vllm_lora_kwargs(model_dir: Path, args) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: ``vllm_peer``'s and the LoRA options."""
    return {**engine_kwargs(model_dir, args), **lora_engine_kwargs(args)}


def run_vllm_loras(model_dir: Path, args, prompts, out_lens, adapter_dirs) -> dict[str, Any]:
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise SystemExit(f"{VLLM_MISSING} ({e})") from e

    llm = LLM(**vllm_lora_kwargs(model_dir, args))
    requests = [LoRARequest(f"lora-{k}", k + 1, str(d)) for k, d in enumerate(adapter_dirs)]
    for request in requests:
        llm.llm_engine.add_lora(request)
    probe = [{"prompt_token_ids": prompts[0][:16]}] * (len(requests) + 1)
    greedy = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=PROBE_TOKENS, detokenize=False
    )
    outs = llm.generate(probe, greedy, use_tqdm=False, lora_request=[None, *requests])
    base_out, *lora_outs = [list(o.outputs[0].token_ids) for o in outs]
    tokens_prompts, param_kwargs = workload(prompts, out_lens, args)
    params = [SamplingParams(**kw) for kw in param_kwargs]
    rows: list[dict[str, Any]] = []
    for n in [0, *args.loras]:
        per_prompt = mix(requests[:n], len(prompts)) if n else None
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(tokens_prompts, params, use_tqdm=False, lora_request=per_prompt)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != sum(out_lens):
            raise RuntimeError(f"vLLM produced {produced} tokens, expected {sum(out_lens)}")
        base = rows[0]["output_tok_per_s"] if rows else produced / elapsed
        rows.append(row(n, produced, elapsed, base))
        print(
            f"vLLM {vllm.__version__}, {n} adapters: {rows[-1]['output_tok_per_s']:.1f} output "
            f"tok/s ({rows[-1]['ratio_vs_base']:.2f}x its row 0)",
            flush=True,
        )
    return {
        "version": vllm.__version__,
        "engine_kwargs": vllm_lora_kwargs(model_dir, args),
        "probe_differs_from_base": [out != base_out for out in lora_outs],
        "rows": rows,
    }
