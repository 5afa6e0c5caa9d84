"""`pdserve generate`: stream one request from a running router, and say plainly
why it failed.

Start-up matters here (a user waits for it before every request), so this
module imports only the standard library at import time; grpc and the
generated protos load inside ``cmd_generate``, and nothing loads the engine or
torch (tests/integration/test_operator_ux.py checks the import set).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

DEFAULT_ADDRESS = "127.0.0.1:50051"
PUBLIC_PORT, ADMIN_PORT = 50051, 50052  # `pdserve up`'s defaults
ADMIN_SERVICE = "pdserve.v1.Admin"  # proto/admin.proto


def command_name(script: str, module: str) -> str:
    """How the user can run ``script`` from where they stand: its bare name
    when that is on PATH, else the virtualenv's copy (relative when below the
    working directory), else ``python -m module``."""
    here = Path(sys.executable).parent
    found = shutil.which(script)
    if found and Path(found).resolve().parent == here.resolve():
        return script
    local = here / script
    if local.exists():
        try:
            return str(local.relative_to(Path.cwd()))
        except ValueError:
            return str(local)
    return f"{sys.executable} -m {module}"


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    """Every flag shows its default (the parser uses ArgumentDefaultsHelpFormatter)."""
    env = os.environ.get
    gen.add_argument(
        "prompt", help='the prompt text (a user message with --chat); "-" reads it from stdin'
    )
    gen.add_argument(
        "--address",
        default=env("PDSERVE_ADDRESS", DEFAULT_ADDRESS),
        help="the router's public API, HOST:PORT [PDSERVE_ADDRESS]",
    )
    gen.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="most tokens to generate; prompt + max tokens must fit the model's context",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling (server: 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="0 or -1: all tokens (server: 0)")
    gen.add_argument("--min-p", type=float, default=None, help="(server: 0.0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeat for more)"
    )
    gen.add_argument("--n", type=int, default=1, help="completions of the prompt")
    gen.add_argument(
        "--logprobs", type=int, default=None, help="print this many top log-probs per token"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole request")
    gen.add_argument(
        "--token", default=env("PDSERVE_TOKEN"), help="the router's API token [PDSERVE_TOKEN]"
    )


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling fields to send; unset ones keep the server's defaults."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "n": args.n if args.n != 1 else None,
        "logprobs": args.logprobs,
        "ignore_eos": args.ignore_eos or None,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from common.tls import TLSConfig, make_sync_channel
    from proto.client import generate

    tls = TLSConfig.from_args(args)
    channel = make_sync_channel(args.address, tls)
    # "-": the prompt comes on stdin (a long one does not fit in argv).
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt = None if args.chat else text
    kwargs = sampling_kwargs(args)
    if args.chat:
        kwargs["chat"] = [{"role": "user", "content": text}]
    final = None
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list] = {}
    received = 0
    try:
        for response in generate(
            args.address, prompt, timeout=args.timeout, token=args.token, channel=channel, **kwargs
        ):
            for delta in response.deltas:
                received += len(delta.token_ids)
                if args.n == 1:  # one completion: stream it as it comes
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                texts.setdefault(delta.index, []).append(delta.text)
                logprobs.setdefault(delta.index, []).extend(delta.logprobs)
            if response.HasField("final"):
                final = response.final
    except grpc.RpcError as e:
        if args.n == 1 and any(texts.get(0, ())):  # end the streamed line first
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(f"pdserve: error: {explain_error(e, args, received, channel)}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    _print_completions(args, texts, logprobs)
    if final is not None:
        _print_usage(final)
    return 0


def _print_completions(args: argparse.Namespace, texts: dict, logprobs: dict) -> None:
    """What is left to print once the stream ended: the completions of n > 1
    (one streams as it comes), and the logprobs where asked."""
    if args.n == 1:
        sys.stdout.write("\n")
    else:
        for index in sorted(texts):
            sys.stdout.write(f"[{index}] {''.join(texts[index])}\n")
    if args.logprobs is not None:
        for index in sorted(logprobs):
            for lp in logprobs[index]:
                top = ", ".join(f"{t.text!r} {t.logprob:.3f}" for t in lp.top)
                sys.stdout.write(f"[{index}] token {lp.token_id} logprob {lp.logprob:.3f}: {top}\n")
    sys.stdout.flush()


def _print_usage(final) -> None:
    from proto import pdserve_pb2

    u = final.usage
    reasons = ", ".join(
        pdserve_pb2.FinishReason.Name(c.finish_reason).removeprefix("FINISH_REASON_").lower()
        for c in final.completions
    )
    print(
        f"[{u.prompt_tokens} prompt ({u.cached_tokens} cached) + {u.completion_tokens} "
        f"completion tokens; first token in {u.time_to_first_token_ms:.0f} ms; "
        f"finish: {reasons or 'unknown'}; "
        f"prefill: {u.prefill_node or 'on the decode node'}; decode: {u.decode_node}]",
        file=sys.stderr,
    )


def explain_error(e, args: argparse.Namespace, received: int, channel) -> str:
    """One line: the status, the router's words, and what to do when we know."""
    import grpc

    code, details = e.code(), e.details() or ""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"DEADLINE_EXCEEDED: the request did not finish within --timeout "
            f"({args.timeout:g} s; {received} tokens received); raise --timeout or lower "
            f"--max-tokens"
        )
    if code is grpc.StatusCode.UNIMPLEMENTED and serves_admin(channel):
        host = args.address.rsplit(":", 1)[0]
        return (
            f"{args.address} serves the admin API (pdctl --address {args.address}), not "
            f"generation; the public API is usually on port {PUBLIC_PORT} "
            f"(--address {host}:{PUBLIC_PORT}; `pdserve up` prints it)"
        )
    if code is grpc.StatusCode.UNAVAILABLE and not received:
        return f"UNAVAILABLE: no router answers at {args.address} ({details})"
    return f"{code.name}: {details}"


def serves_admin(channel) -> bool:
    """Whether the server behind ``channel`` says its admin service is SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=ADMIN_SERVICE), timeout=2.0
        )
    except (grpc.RpcError, ValueError):  # ValueError: the channel is closed
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def add_generate_parser(sub) -> argparse.ArgumentParser:
    """The `generate` subcommand on ``sub`` (argparse subparsers)."""
    from common.tls import add_client_tls_arguments

    gen = sub.add_parser(
        "generate",
        help="stream a generation from a running router",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_generate_arguments(gen)
    add_client_tls_arguments(gen, "PDSERVE")
    gen.set_defaults(func=cmd_generate)
    return gen


def is_generate(argv: list[str]) -> bool:
    """Whether the subcommand in ``argv`` is `generate` (global flags may precede it)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command == "generate"


def generate_only_parser(description: str) -> argparse.ArgumentParser:
    """`pdserve` with only `generate`: what the fast path parses (same flags, same help)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=description)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser
