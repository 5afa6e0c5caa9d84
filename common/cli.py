"""`pdserve`: the command line for running and preparing pdserve.

pdserve model prepare [--out DIR] [--force]   demo model -> HF directory
pdserve demo [--model DIR] [...]              offline engine on chat prompts
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib.metadata import PackageNotFoundError, version

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Give me a short tip for learning to code.",
]


def _version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from common.models.prepare import PrepareError, prepare_demo_model

    try:
        start = time.perf_counter()
        path, converted = prepare_demo_model(args.out, force=args.force)
    except PrepareError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    if converted:
        print(f"demo model written to {path} in {time.perf_counter() - start:.1f} s")
    else:
        print(f"demo model already prepared at {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from common import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    conversations = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outputs, strict=True):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    device = llm.llm_engine.model_runner.device
    print(
        f"\n{len(outputs)} requests on {device}: {num_prompt} prompt + {num_out} output tokens "
        f"in {elapsed:.2f} s -> {num_out / elapsed:.1f} output tok/s, "
        f"{(num_prompt + num_out) / elapsed:.1f} total tok/s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model files")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser(
        "prepare", help="convert the demo model (SmolLM2-135M-Instruct) into an HF directory"
    )
    prepare.add_argument("--out", default="models/smollm2-135m-instruct", help="output directory")
    prepare.add_argument("--force", action="store_true", help="convert again even if present")
    prepare.set_defaults(func=cmd_model_prepare)

    demo = sub.add_parser("demo", help="run the offline engine on a few chat prompts")
    demo.add_argument("--model", default="models/smollm2-135m-instruct", help="HF model directory")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--max-model-len", type=int, default=2048)
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    demo.add_argument("--attention-backend", default="auto")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except ValueError as e:
        # Bad configuration or input: one line, no traceback.
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
