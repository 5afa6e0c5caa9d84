"""`pdserve`: the command line for running and preparing pdserve.

pdserve up --model DIR [--prefill N] [--decode M] [--prefill-tp A] [--decode-tp B] [--port 50051] [--redis-url URL]
pdserve router|prefill|decode --model DIR [...]   one component (flags or PDSERVE_* variables)
pdserve generate PROMPT|- [--address HOST:PORT] [--max-tokens N] [--temperature T] [--chat]
                 [--top-p P] [--top-k K] [--min-p P] [--stop S] [--n N] [--logprobs K]
                 [--ignore-eos] [--timeout S]
                 [--token T] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]
pdserve model prepare [--out DIR] [--force]      demo model -> HF directory
pdserve demo [--model DIR] [...]                 offline engine on chat prompts
pdserve bench serve|plot [...]                   serving benchmark (docs/performance.md)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

DESCRIPTION = __doc__.split("\n")[0]
# The processes `pdserve up` starts, each a subcommand of its own.
COMPONENTS = {
    "router": "run the router (public and admin API)",
    "prefill": "run one prefill node",
    "decode": "run one decode node",
}
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
    # Processes started by `pdserve up` share a terminal: say who is speaking.
    who = os.environ.get("PDSERVE_LOG_NAME")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {who + ' ' if who else ''}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from engine.models.prepare import PrepareError, prepare_demo_model

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
    from engine import LLM, SamplingParams

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


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_float(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return x


def cmd_component(args: argparse.Namespace) -> int:
    from common.runtime.event_loop import run

    return run(lambda: args.serve(args), args.event_loop)


def _check_speculative_config(value: str | None) -> None:
    """Refused now, not by every decode node at its start."""
    if value:
        from decode_node.main import speculative_config_arg

        try:
            speculative_config_arg(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--speculative-config: {e}") from None


def cmd_up(args: argparse.Namespace) -> int:
    from common.tls import TLSConfig
    from pdserve.launcher import ClusterSpec, LocalCluster
    from pdserve.supervisor import SupervisorConfig
    from pdserve.up import run_up

    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    tls = TLSConfig.from_args(args)
    if tls.serves_tls != tls.calls_tls:
        # One certificate set for every process: each is a server and a client.
        raise ValueError("pdserve up with TLS wants --tls-cert, --tls-key and --tls-ca together")
    engine_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    engine_args += lora_node_args(args)
    _check_speculative_config(args.speculative_config)
    spec = ClusterSpec(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        redis_url=args.redis_url,
        engine_args=engine_args,
        node_args=["--verify-kv"] if args.verify_kv else [],
        decode_args=(
            ["--speculative-config", args.speculative_config] if args.speculative_config else []
        ),
        router_args=(["--routing-policy", args.routing_policy] if args.routing_policy else [])
        + (["--api-tokens-file", args.api_tokens_file] if args.api_tokens_file else [])
        + (["--no-migration"] if args.no_migration else [])
        + (["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else [])
        + (["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else [])
        + (["--allow-runtime-lora-updating"] if args.allow_runtime_lora_updating else [])
        + (["--trust-request-chat-template"] if args.trust_request_chat_template else [])
        + (
            ["--migration-wait", str(args.migration_wait)]
            if args.migration_wait is not None
            else []
        ),
        num_routers=args.routers,
        http_port=args.http_port,
        log_dir=args.log_dir,
        metrics_port=args.metrics_port,
        supervised=not args.no_restart,
        tls=tls,
        redis_password=args.redis_password,
        redis_username=args.redis_username,
        redis_tls_ca=args.redis_tls_ca,
        # Secrets go to the children through the environment, not argv (which
        # every local user can read in the process list).
        env={"PDSERVE_ADMIN_TOKEN": args.admin_token} if args.admin_token else {},
        cpu_threads=args.cpu_threads,
    )
    config = SupervisorConfig(
        max_crashes=args.max_restarts, window_s=args.restart_window, restart=not args.no_restart
    )
    return run_up(LocalCluster(spec), config, lambda cluster: print_ready(cluster, args, tls))


def lora_node_args(args: argparse.Namespace) -> list[str]:
    """The nodes' LoRA flags from ``pdserve up``'s (none without --enable-lora
    or --lora-modules)."""
    if not (args.lora_modules or args.enable_lora):
        if args.max_loras or args.max_lora_rank:
            raise ValueError(
                "--max-loras and --max-lora-rank go with --enable-lora or --lora-modules"
            )
        return []
    out = ["--enable-lora"]
    if args.lora_modules:
        out += ["--lora-modules", *args.lora_modules]
    if args.max_loras:
        out += ["--max-loras", str(args.max_loras)]
    if args.max_lora_rank:
        out += ["--max-lora-rank", str(args.max_lora_rank)]
    return out


def print_ready(cluster, args: argparse.Namespace, tls) -> None:
    """The addresses and commands to try, once a router and a decode node serve."""
    for i, (address, admin) in enumerate(
        zip(cluster.router_addresses, cluster.admin_addresses, strict=True)
    ):
        print(f"router listening on {address} (admin API on {admin})", flush=True)
        if cluster.http_ports:
            scheme = "https" if tls.serves_tls else "http"
            print(f"OpenAI API on {scheme}://{args.host}:{cluster.http_ports[i]}/v1", flush=True)
    # With TLS the example commands need the client's files; with tokens, a token.
    tls_flags = "".join(f" {flag} {path}" for flag, path in tls.paths if flag != "--tls-client-ca")
    gen_token = " --token TOKEN" if args.api_tokens_file else ""
    admin_token = " --token ADMIN_TOKEN" if args.admin_token or args.api_tokens_file else ""
    from pdserve.generate import command_name

    # Commands that work from here: `pdserve` may not be on PATH (an unactivated venv).
    pdserve, pdctl = (
        command_name("pdserve", "pdserve.cli"),
        command_name("pdctl", "router.admin.pdctl"),
    )
    print(
        f'try: {pdserve} generate "What is the capital of France?" --chat '
        f"--address {cluster.router_address}{gen_token}{tls_flags}\n"
        f"     {pdctl} --address {cluster.admin_address}{admin_token}{tls_flags} nodes",
        flush=True,
    )


def _component_module(name: str):
    """The main module of component ``name`` (imported only when it runs)."""
    if name == "router":
        from router import main
    elif name == "prefill":
        from prefill_node import main
    else:
        from decode_node import main
    return main


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser. Given the ``command`` that runs, a component
    other than it keeps a bare subcommand: its module is never imported, so a
    router or `pdserve up` never loads the nodes' (torch, the engine); None
    builds every component's flags (docs/flags.md's generator)."""
    from common.metrics.server import DEFAULT_METRICS_PORT, metrics_port

    parser = argparse.ArgumentParser(prog="pdserve", description=DESCRIPTION)
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

    env = os.environ.get
    up = sub.add_parser("up", help="run a whole cluster locally (Redis, nodes, router)")
    up.add_argument(
        "--model", default=env("PDSERVE_MODEL"), help="HF model directory [PDSERVE_MODEL]"
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="decode nodes")
    up.add_argument(
        "--prefill-tp",
        type=positive_int,
        default=1,
        help="tensor-parallel size of each prefill node: its ranks, one GPU each (default 1)",
    )
    up.add_argument(
        "--decode-tp",
        type=positive_int,
        default=1,
        help="tensor-parallel size of each decode node (default 1); may differ from "
        "--prefill-tp: each decode rank receives its own KV heads",
    )
    up.add_argument(
        "--host", default="127.0.0.1", help="address every process listens on and advertises"
    )
    # The router's own variables: `make run PDSERVE_PORT=50061` moves the stack.
    up.add_argument(
        "--port",
        type=int,
        default=int(env("PDSERVE_PORT", "50051")),
        help="router port [PDSERVE_PORT]",
    )
    up.add_argument(
        "--admin-port",
        type=int,
        default=int(env("PDSERVE_ADMIN_PORT", "50052")),
        help="router admin API port [PDSERVE_ADMIN_PORT]",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=int(env("PDSERVE_HTTP_PORT") or 0) or None,
        help="OpenAI-compatible HTTP API port of the router (docs/openai.md); off when unset "
        "[PDSERVE_HTTP_PORT]",
    )
    up.add_argument("--routers", type=int, default=1, help="router replicas")
    up.add_argument(
        "--admin-token",
        default=env("PDSERVE_ADMIN_TOKEN"),
        help="admin API token (pdctl --token) [PDSERVE_ADMIN_TOKEN]",
    )
    up.add_argument(
        "--routing-policy",
        choices=["cost", "round-robin", "random"],
        default=None,
        help="default cost (docs/routing.md)",
    )
    up.add_argument(
        "--redis-url",
        default=env("PDSERVE_REDIS_URL"),
        help="use this Redis, start none [PDSERVE_REDIS_URL]",
    )
    up.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output, for the nodes and the routers (default: the model's)",
    )
    up.add_argument("--verify-kv", action="store_true", help="checksum every KV transfer")
    up.add_argument(
        "--speculative-config",
        default=None,
        help="the decode nodes' speculative decoding, vLLM's JSON form (docs/engine.md), "
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; every decode node alike '
        "(a mixed cluster: start the decode nodes with `pdserve decode`, each with its own)",
    )
    up.add_argument(
        "--cpu-threads",
        type=int,
        # A string default goes through `type`: a bad value is reported like a bad flag.
        default=env("PDSERVE_CPU_THREADS") or None,
        help="CPU threads per engine process (OMP_NUM_THREADS); default on a CPU host: "
        "the usable cores shared by the nodes' processes, or OMP_NUM_THREADS where it is "
        "set; 0: torch's default [PDSERVE_CPU_THREADS]",
    )
    up.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=None,
        help="PEFT LoRA adapters every node reads and checks at start (LoRA on); requests "
        "name one by its NAME in `model` (docs/usage.md, Serving LoRA adapters)",
    )
    up.add_argument(
        "--enable-lora",
        action="store_true",
        help="LoRA on without adapters at start: load them at run time (pdctl lora load)",
    )
    up.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="the routers' --allow-runtime-lora-updating: vLLM's /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter on the HTTP API (admin token required)",
    )
    up.add_argument(
        "--max-loras", type=positive_int, default=None, help="adapters on a node's device at once"
    )
    up.add_argument(
        "--max-lora-rank", type=positive_int, default=None, help="the largest adapter rank"
    )
    up.add_argument("--log-dir", default=None, help="write each process's log here")
    up.add_argument(
        "--no-restart",
        action="store_true",
        help="stop everything when a component exits (default: restart it, with backoff)",
    )
    up.add_argument(
        "--max-restarts",
        type=positive_int,
        default=5,
        help="give up on a component that exits more often than this within --restart-window "
        "(default 5)",
    )
    up.add_argument(
        "--restart-window",
        type=positive_float,
        default=120.0,
        help="seconds over which --max-restarts counts exits (default 120)",
    )
    up.add_argument(
        "--no-migration",
        action="store_true",
        help="a stream fails with its decode node (default: it continues on another)",
    )
    up.add_argument(
        "--migration-wait",
        type=float,
        default=None,
        help="seconds a stream whose decode node died waits for a decode node to take it "
        "when none can now (the routers' --migration-wait; default 15)",
    )
    up.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="the routers' --tool-call-parser: the model family's tool-call format, for "
        "the HTTP API's tool_choice auto (docs/openai.md)",
    )
    up.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1"),
        default=None,
        help="the routers' --reasoning-parser: a thinking model's reasoning_content",
    )
    up.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="the routers' --trust-request-chat-template: honour a request's own "
        "chat_template (refused without it, as vLLM's)",
    )
    up.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=metrics_port(os.environ.get("PDSERVE_METRICS_PORT", str(DEFAULT_METRICS_PORT))),
        help="first /metrics port: the router's; the other processes take the next ones, "
        "the supervisor (restarts) the last "
        f"(default {DEFAULT_METRICS_PORT}; 0 disables) [PDSERVE_METRICS_PORT]",
    )
    # Security (docs/security.md): the same files for every process it starts.
    from common.auth import add_token_arguments
    from common.cluster.redis_auth import add_redis_auth_arguments
    from common.tls import add_tls_arguments

    add_token_arguments(up)
    add_tls_arguments(up)
    add_redis_auth_arguments(up)
    up.set_defaults(func=cmd_up)

    from common.runtime.event_loop import add_event_loop_argument

    for name, text in COMPONENTS.items():
        p = sub.add_parser(name, help=text)
        if command not in (None, name):
            continue  # not the one run: its module (the nodes': torch) stays unloaded
        module = _component_module(name)
        module.add_arguments(p)
        add_event_loop_argument(p)
        p.set_defaults(func=cmd_component, serve=module.serve)

    from pdserve.generate import add_generate_parser

    add_generate_parser(sub)

    # `pdserve bench serve|plot` (pdserve/bench); building its parser loads no client.
    from pdserve.bench.cli import add_bench_parsers

    add_bench_parsers(sub.add_parser("bench", help="serving benchmark: load sweeps, plots"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.generate import generate_only_parser, is_generate

    argv = sys.argv[1:] if argv is None else argv
    # `generate` must start fast: the full parser imports the nodes (torch, the engine).
    if is_generate(argv):
        parser = generate_only_parser(DESCRIPTION)
    else:
        # The subcommand that runs ("" for none: --version, --help), so that only
        # its component's module is imported.
        parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except ValueError as e:
        # Bad configuration or input: one line, no traceback.
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pdserve generate ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
