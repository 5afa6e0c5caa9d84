"""`pdserve bench serve` and `pdserve bench plot`: arguments and the sweep.

    pdserve bench serve --backend openai --base-url http://127.0.0.1:8000 \\
        --dataset random --random-input-len 1024 --random-output-len 128 --ignore-eos \\
        --request-rate 1 2 4 8 inf --num-prompts 200 --slo ttft:500,tpot:50 --label pdserve
    pdserve bench plot A.json B.json --out sweep.png

Only argparse and the enums load when `pdserve` builds its parser; the
load generator, HTTP client and matplotlib load when a command runs.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

from common.runtime.event_loop import add_event_loop_argument
from common.runtime.event_loop import run as run_on_loop
from pdserve.bench.backends import BackendKind
from pdserve.bench.datasets import DatasetKind, PromptFormat


def _rate(text: str) -> float:
    value = float(text)  # "inf" parses
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be positive (or inf)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument(
        "--backend", type=BackendKind, choices=list(BackendKind), default=BackendKind.OPENAI
    )
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    g.add_argument("--address", default="127.0.0.1:50051", help="pdserve router (gRPC backend)")
    g.add_argument("--model", default="", help="model name to send (OpenAI); default: none")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters the server has loaded: request i names the (i mod N)-th "
        "(OpenAI model field, gRPC's model); default: --model for every request",
    )
    g.add_argument("--api-key", default=None, help="bearer token (either backend)")
    g.add_argument("--label", default=None, help="system name in records and plots")
    g.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    g.add_argument("--num-gpus", type=_positive, default=1, help="for tok/s per GPU")
    g.add_argument(
        "--server-device",
        default=None,
        help="the server's device for the record (default: this host's GPUs, if any)",
    )

    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset", type=DatasetKind, choices=list(DatasetKind), default=DatasetKind.RANDOM
    )
    d.add_argument("--num-prompts", type=_positive, default=200)
    d.add_argument(
        "--prompt-format",
        type=PromptFormat,
        choices=list(PromptFormat),
        default=PromptFormat.TOKEN_IDS,
    )
    d.add_argument(
        "--vocab-size", type=_positive, default=None, help="default: --model-dir's, else 32000"
    )
    d.add_argument("--model-dir", default=None, help="read vocab_size from this HF config")
    d.add_argument("--random-input-len", type=_positive, default=1024)
    d.add_argument("--random-output-len", type=_positive, default=128, help="every dataset's")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in mean*(1±r)")
    d.add_argument("--shared-prefix-groups", type=_positive, default=8)
    d.add_argument("--shared-prefix-prompts-per-group", type=_positive, default=32)
    d.add_argument("--shared-prefix-system-len", type=_positive, default=2048)
    d.add_argument("--shared-prefix-question-len", type=_positive, default=128)
    d.add_argument("--multi-turn-users", type=_positive, default=24)
    d.add_argument("--multi-turn-turns", type=_positive, default=5)
    d.add_argument("--multi-turn-systems", type=_positive, default=4)
    d.add_argument("--multi-turn-system-len", type=_positive, default=256)
    d.add_argument("--multi-turn-min-user-len", type=_positive, default=48)
    d.add_argument("--multi-turn-max-user-len", type=_positive, default=128)
    d.add_argument(
        "--json-schema-count",
        type=_positive,
        default=8,
        help="json-schema: distinct schemas, sent in turn (each a grammar of its own)",
    )
    d.add_argument(
        "--jsonl-path", type=Path, default=None, help='lines {"prompt": ..., "output_len": N}'
    )
    d.add_argument("--ignore-eos", action="store_true", help="generate exactly the asked lengths")

    lo = p.add_argument_group("load")
    lo.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        help="req/s; several sweep; inf",
    )
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    lo.add_argument("--max-concurrency", type=_positive, default=None)
    lo.add_argument("--num-warmups", type=int, default=0, help="requests sent first, not counted")
    lo.add_argument("--seed", type=int, default=0, help="prompts (each rate adds its index)")
    lo.add_argument(
        "--arrival-seed",
        type=int,
        default=None,
        help="arrival gaps (default --seed): the same arrivals with other prompts, "
        "for a second sweep on a server whose prefix cache holds the first's",
    )
    lo.add_argument("--slo", default="", help="goodput objective, e.g. ttft:500,tpot:50 (ms)")
    # The generator's own loop: uvloop where installed, as the servers run. Every
    # stream's chunks are parsed on this one loop, so its CPU per chunk bounds the
    # rate the generator can keep to its schedule
    # (docs/lab/2026-11-26-load-generator-capacity.md).
    add_event_loop_argument(lo)

    o = p.add_argument_group("output")
    o.add_argument(
        "--scrape-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a Prometheus endpoint (repeatable) read before and after each rate: every "
        "histogram's count, mean, p50 and p90 over the rate go in the record, e.g. the "
        "server's queue and prefill time (pdserve/bench/scrape.py)",
    )
    o.add_argument("--result-dir", type=Path, default=None, help="default benchmarks/results")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_serve)


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser(
        "serve", help="load sweep against a server: latency, throughput, goodput"
    )
    add_serve_arguments(serve)
    plot = sub.add_parser("plot", help="plot serve records, one curve per record")
    plot.add_argument("records", nargs="+", type=Path)
    plot.add_argument("--out", type=Path, default=Path("serve.png"))
    plot.set_defaults(func=cmd_plot)


def arrival_seed(args: argparse.Namespace) -> int:
    """The seed of the arrival gaps: ``--arrival-seed``, else ``--seed``."""
    return args.seed if args.arrival_seed is None else args.arrival_seed


def build_dataset(args: argparse.Namespace, seed: int):
    from pdserve.bench import datasets as ds

    dataset = _build_dataset(args, seed)
    if args.lora_modules:
        ds.assign_lora_modules(dataset, args.lora_modules)
    return dataset


def _build_dataset(args: argparse.Namespace, seed: int):
    from pdserve.bench import datasets as ds

    vocab = args.vocab_size
    if vocab is None and args.model_dir:
        import json

        vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    vocab = vocab or 32000
    out_len, fmt = args.random_output_len, args.prompt_format
    match args.dataset:
        case DatasetKind.RANDOM:
            reqs = ds.random_requests(
                args.num_prompts,
                args.random_input_len,
                out_len,
                vocab,
                seed,
                args.random_range_ratio,
                fmt,
            )
            return ds.Dataset(args.dataset, reqs)
        case DatasetKind.SHARED_PREFIX:
            reqs = ds.shared_prefix_requests(
                args.shared_prefix_groups,
                args.shared_prefix_prompts_per_group,
                args.shared_prefix_system_len,
                args.shared_prefix_question_len,
                out_len,
                vocab,
                seed,
                fmt,
            )
            return ds.Dataset(args.dataset, reqs)
        case DatasetKind.MULTI_TURN:
            spec = ds.MultiTurnSpec(
                users=args.multi_turn_users,
                turns=args.multi_turn_turns,
                systems=args.multi_turn_systems,
                system_tokens=args.multi_turn_system_len,
                min_user_tokens=args.multi_turn_min_user_len,
                max_user_tokens=args.multi_turn_max_user_len,
                output_tokens=out_len,
            )
            w = ds.MultiTurnWorkload.make(spec, vocab, seed)
            return ds.Dataset(args.dataset, w.first_turns(), multi_turn=w)
        case DatasetKind.JSON_SCHEMA:
            return _json_schema_dataset(args, vocab, seed)
        case DatasetKind.JSONL:
            if args.jsonl_path is None:
                raise ValueError("--dataset jsonl needs --jsonl-path")
            reqs = ds.jsonl_requests(args.jsonl_path, out_len, args.num_prompts, seed)
            return ds.Dataset(args.dataset, reqs)
    raise ValueError(f"unknown dataset {args.dataset}")  # pragma: no cover


def _json_schema_dataset(args: argparse.Namespace, vocab: int, seed: int):
    from pdserve.bench import datasets as ds

    if args.ignore_eos:
        raise ValueError(
            "--dataset json-schema: a grammar ends each output where its JSON ends, "
            "so --ignore-eos cannot be honoured (--random-output-len is max_tokens)"
        )
    reqs = ds.json_schema_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        vocab,
        seed,
        args.json_schema_count,
        args.random_range_ratio,
        args.prompt_format,
    )
    return ds.Dataset(args.dataset, reqs)


def make_backend(args: argparse.Namespace):
    from pdserve.bench.backends import GrpcBackend, OpenAIBackend, SamplingOptions

    opts = SamplingOptions(
        model=args.model,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        want_token_ids=args.dataset is DatasetKind.MULTI_TURN,
    )
    if args.backend is BackendKind.GRPC:
        return GrpcBackend(args.address, opts, args.api_key)
    return OpenAIBackend(args.base_url, opts, args.api_key)


async def sweep(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    """Every rate in turn; returns {"record": path, "plot": path|None, "rates": [...]}."""
    from pdserve.bench.devices import server_device
    from pdserve.bench.metrics import parse_slo
    from pdserve.bench.report import DEFAULT_RESULT_DIR, write_record
    from pdserve.bench.scrape import Scraper

    slo = parse_slo(args.slo) if args.slo else None
    # Each rate (and the warm-up) gets prompts of its own seed: with the same
    # prompts, a server's prefix cache would serve rate k+1 what rate k computed.
    # (A jsonl file's prompts are the same at every rate.)
    datasets = [build_dataset(args, args.seed + i) for i in range(len(args.request_rate))]
    label = args.label or args.backend.value
    scraper = await Scraper.start(args.scrape_metrics) if args.scrape_metrics else None
    backend = make_backend(args)
    params = {
        k: (v.value if hasattr(v, "value") else str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "func"
    }
    result_dir = args.result_dir or DEFAULT_RESULT_DIR
    rates: list = []
    path = None
    stamp = time.strftime("%Y%m%d-%H%M%S")  # the record's name and timestamp, every write
    device = server_device(args.server_device)  # once, not at every rate's write
    save = functools.partial(
        write_record, result_dir, label, args.dataset.value, params, rates, argv,
        stamp=stamp, server_device=device,
    )  # fmt: skip
    try:
        if args.num_warmups > 0:
            await _warm_up(args, backend)
        for rate, dataset in zip(args.request_rate, datasets, strict=True):
            rates.append(await _one_rate(args, backend, dataset, rate, slo, scraper))
            # Kept after every rate: a sweep stopped later keeps what it measured.
            path = save(path, False)
    finally:
        await backend.close()
        if scraper:
            await scraper.close()
    path = save(path, True)
    print(f"record: {path}")
    png = None
    if not args.no_plot:
        from pdserve.bench.plot import plot_records
        from pdserve.bench.report import load_record

        png = plot_records([load_record(path)], path.with_suffix(".png"))
        print(f"plot: {png}")
    return {"record": path, "plot": png, "rates": [m for m, _ in rates]}


async def _warm_up(args: argparse.Namespace, backend) -> None:
    from pdserve.bench.loadgen import warm_up

    warm = build_dataset(args, args.seed + 1_000_003).requests[: args.num_warmups]
    bad = [r.error for r in await warm_up(backend, warm) if not r.success]
    if bad:
        print(f"warm-up: {len(bad)} of {len(warm)} failed: {bad[0]}", file=sys.stderr)


async def _one_rate(args: argparse.Namespace, backend, dataset, rate: float, slo, scraper):
    """One rate's run: its metrics (printed as a table) and the record's extras."""
    from tqdm import tqdm

    from pdserve.bench.loadgen import run_rate
    from pdserve.bench.metrics import compute
    from pdserve.bench.report import table

    before = await scraper.snapshot() if scraper else None
    bar = tqdm(
        total=dataset.total_requests,
        desc=f"rate {rate:g}",
        disable=True if args.no_progress else None,
        file=sys.stderr,
    )
    run = await run_rate(
        backend,
        dataset,
        rate,
        args.burstiness,
        args.max_concurrency,
        arrival_seed(args),
        on_done=lambda _r: bar.update(),
    )
    bar.close()
    m = compute(run.results, run.duration_s, rate, slo, args.max_concurrency)
    print(table(m, args.slo), flush=True)
    extra = {
        "send_lag_mean_ms": run.send_lag_mean_ms,
        "send_lag_max_ms": run.send_lag_max_ms,
        "generator_gc_full_collections": run.gc_full_collections,
        "generator_gc_longest_pause_ms": run.gc_longest_pause_ms,
    }
    if dataset.kind is DatasetKind.JSON_SCHEMA:
        extra["json_outputs"] = json_outputs(run.results)
        print(f"JSON outputs: {extra['json_outputs']}", flush=True)
    if scraper:
        extra["server_histograms"] = await scraper.since(before)
        print(scraper.lines(extra["server_histograms"]), flush=True)
    return m, extra


def json_outputs(results: list) -> dict:
    """How many successful outputs parse as a JSON object: a server that
    ignored the schema would be measured on other work (outputs cut by
    max_tokens do not parse; a server that sends no text has none)."""
    import contextlib
    import json

    texts = [r.text for r in results if r.success]
    parsed = 0
    for text in texts:
        with contextlib.suppress(ValueError):  # not JSON: not counted
            parsed += isinstance(json.loads(text), dict)
    return {"succeeded": len(texts), "parsed": parsed}


def cmd_serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    out = run_on_loop(lambda: sweep(args, argv), args.event_loop)
    # Exit 1 when nothing succeeded: a sweep of failures is not a figure.
    return 0 if any(m.completed for m in out["rates"]) else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from pdserve.bench.plot import plot_records
    from pdserve.bench.report import load_record

    print(f"plot: {plot_records([load_record(p) for p in args.records], args.out)}")
    return 0
