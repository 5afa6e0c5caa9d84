"""`pdserve router`: the public API server (and the admin API on its own port)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass, fields

import grpc

from common.auth import add_token_arguments, router_interceptors
from common.cluster.redis_auth import add_redis_auth_arguments, check_redis, redis_options_from_args
from common.cluster.state import Cluster
from common.grpc_server import (
    PUBLIC_SERVER_OPTIONS,
    MetadataLimitInterceptor,
    add_health,
    add_lenient_servicer,
    add_reflection,
    set_serving,
)
from common.metrics.gc import GcCollector
from common.metrics.server import add_metrics_arguments, serve_metrics
from common.runtime.gc_heap import GcPauses, add_gc_arguments, freeze_heap
from common.runtime.ports import PlannedPort, check_free, listen, router_listeners
from common.tls import TLSConfig, add_tls_arguments
from common.tracing import Tracing, add_tracing_arguments
from engine.config import EngineConfig
from proto import admin_pb2, admin_pb2_grpc, pdserve_pb2
from router.admin.service import AdminServicer
from router.frontend import Frontend
from router.http.reasoning import REASONING_PARSERS
from router.http.tool_parsers import TOOL_CALL_PARSERS
from router.metrics import RouterCollector
from router.policy import RoutingConfig, RoutingPolicy
from router.routing import Routing
from router.service import RouterServicer

logger = logging.getLogger(__name__)
ROUTER_SERVICE = pdserve_pb2.DESCRIPTOR.services_by_name["Router"]
ROUTER = ROUTER_SERVICE.full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
# Seconds the HTTP edge keeps an idle keep-alive connection open: above the 60 s idle
# timeout load balancers and ingresses commonly use (AWS ALB's default, ingress-nginx's
# upstream keep-alive), so that the proxy, not the server, closes an idle connection
# first. A server that closes first races the proxy reusing that connection, and the
# request sent on it is lost (connection reset / server disconnected). uvicorn's own
# default, 5 s, loses them; a proxy that idles longer needs the flag above its timeout.
HTTP_KEEP_ALIVE_S = 65


def keep_alive_seconds(value: str) -> int:
    """--http-keep-alive-s: whole seconds (uvicorn's timeout_keep_alive is an int), >= 1."""
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of seconds, at least 1, got {value!r}"
        )
    return seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--model",
        default=env("PDSERVE_MODEL"),
        help="HF model directory (tokenizer, config) [PDSERVE_MODEL]",
    )
    p.add_argument(
        "--host", default=env("PDSERVE_HOST", "0.0.0.0"), help="listen address [PDSERVE_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env("PDSERVE_PORT", "50051")),
        help="public port [PDSERVE_PORT]",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=int(env("PDSERVE_HTTP_PORT") or 0) or None,
        help="OpenAI-compatible HTTP API port (docs/openai.md); off when unset [PDSERVE_HTTP_PORT]",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        default=int(env("PDSERVE_ADMIN_PORT", "50052")),
        help="admin API port [PDSERVE_ADMIN_PORT]",
    )
    p.add_argument(
        "--redis-url",
        default=env("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="cluster state [PDSERVE_REDIS_URL]",
    )
    p.add_argument(
        "--served-model-name",
        default=env("PDSERVE_SERVED_MODEL_NAME"),
        help="model id in block hashes; must match the nodes' [PDSERVE_SERVED_MODEL_NAME]",
    )
    p.add_argument(
        "--kvcache-block-size",
        type=int,
        default=int(env("PDSERVE_BLOCK_SIZE", "16")),
        help="must match the nodes' [PDSERVE_BLOCK_SIZE]",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        # The nodes' variable too (common/runtime/config.py): one setting for the whole cluster.
        default=env("PDSERVE_MAX_MODEL_LEN") or None,
        help="longest prompt + output accepted: a cap on what the nodes registered, which "
        "the router serves by itself (docs/openai.md) [PDSERVE_MAX_MODEL_LEN]",
    )
    p.add_argument(
        "--no-remote-prefill",
        action="store_true",
        help="decode nodes prefill everything themselves",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer: accept token-id prompts only (dummy-weight clusters)",
    )
    p.add_argument(
        "--enable-reflection",
        action="store_true",
        default=env("PDSERVE_REFLECTION") == "1",
        help="gRPC server reflection [PDSERVE_REFLECTION=1]",
    )
    p.add_argument(
        "--admin-token",
        default=env("PDSERVE_ADMIN_TOKEN"),
        help="bearer token the admin API requires (tokens from --api-tokens-file with an "
        "admin right work too); without either the admin API listens on 127.0.0.1 only "
        "[PDSERVE_ADMIN_TOKEN]",
    )
    add_token_arguments(p)
    add_tls_arguments(p)
    add_redis_auth_arguments(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("PDSERVE_DRAIN_TIMEOUT_S", "30")),
        help="on SIGTERM, seconds to let streams in flight finish [PDSERVE_DRAIN_TIMEOUT_S]",
    )
    p.add_argument(
        "--http-keep-alive-s",
        type=keep_alive_seconds,
        # A string: argparse converts it like a flag's value (a bad one is a usage error).
        default=env("PDSERVE_HTTP_KEEP_ALIVE_S") or str(HTTP_KEEP_ALIVE_S),
        help="seconds the OpenAI HTTP API keeps an idle keep-alive connection open; keep "
        "it above the idle timeout of any load balancer in front (default "
        f"{HTTP_KEEP_ALIVE_S}, above the common 60 s) [PDSERVE_HTTP_KEEP_ALIVE_S]",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=env("PDSERVE_TOOL_CALL_PARSER") or None,
        help="the model family's tool-call format, for the HTTP API's tool_choice auto "
        "(hermes: Hermes, Qwen2.5, Qwen3; llama3_json: Llama 3.x); unset: tool_choice auto "
        "is refused, required and named work (docs/openai.md) [PDSERVE_TOOL_CALL_PARSER]",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=env("PDSERVE_REASONING_PARSER") or None,
        help="split a thinking model's <think>...</think> into the HTTP API's "
        "reasoning_content and gRPC's Delta.reasoning_text (qwen3, deepseek_r1) "
        "[PDSERVE_REASONING_PARSER]",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        default=env("PDSERVE_TRUST_REQUEST_CHAT_TEMPLATE") == "1",
        help="honour a request's own chat template (the HTTP API's chat_template, "
        "chat_template_kwargs' chat_template, gRPC's ChatMessages.chat_template), as "
        "vLLM's flag of this name; unset: such a request is refused (a template is code the "
        "router runs) [PDSERVE_TRUST_REQUEST_CHAT_TEMPLATE=1]",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=env("PDSERVE_ALLOW_RUNTIME_LORA_UPDATING") == "1",
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the "
        "OpenAI API (admin token required; docs/openai.md); the admin API's LoRA calls "
        "work without it [PDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1]",
    )
    p.add_argument(
        "--no-access-log",
        action="store_true",
        default=env("PDSERVE_NO_ACCESS_LOG") == "1",
        help="no INFO line per request [PDSERVE_NO_ACCESS_LOG=1]",
    )
    add_metrics_arguments(p)
    add_tracing_arguments(p)
    add_gc_arguments(p)
    add_routing_arguments(p)


# Shorter names some routing flags also go by.
ROUTING_FLAG_ALIASES = {"migration_wait_s": ("--migration-wait",)}


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per RoutingConfig field (docs/routing.md explains them)."""
    g = p.add_argument_group("routing (docs/routing.md)")
    defaults = RoutingConfig()
    g.add_argument(
        "--no-migration",
        action="store_true",
        help="fail a stream whose decode node dies after its first token "
        "(default: continue it elsewhere, --max-migrations times)",
    )
    for f in fields(RoutingConfig):
        env_name = f"PDSERVE_{f.name.upper()}"
        default = os.environ.get(env_name)
        if f.name == "policy":
            g.add_argument(
                "--routing-policy",
                dest="policy",
                choices=[x.value for x in RoutingPolicy],
                default=default or defaults.policy.value,
                help=f"[{env_name}]",
            )
            continue
        kind = type(getattr(defaults, f.name))
        g.add_argument(
            f"--{f.name.replace('_', '-')}",
            *ROUTING_FLAG_ALIASES.get(f.name, ()),
            dest=f.name,
            type=kind,
            default=kind(default) if default is not None else getattr(defaults, f.name),
            help=f"default {getattr(defaults, f.name)} [{env_name}]",
        )


def router_ports(args: argparse.Namespace) -> list[PlannedPort]:
    """The router's listeners: gRPC public and admin, and the OpenAI HTTP API when on.
    Not --metrics-port: a metrics port that cannot be bound is logged and
    skipped (common/metrics/server.py); `pdserve up` checks it beforehand."""
    return router_listeners(args.port, args.admin_port, args.http_port)


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    config = RoutingConfig(**{f.name: getattr(args, f.name) for f in fields(RoutingConfig)})
    if getattr(
        args, "no_migration", False
    ):  # streams fail with their decode node, as without migration
        config.max_migrations = 0
    return config


async def serve(args: argparse.Namespace) -> int:
    parts = await _build(args)
    # Before the first port opens: a SIGTERM once anything can reach us drains
    # and exits 0 (at the end of start-up), never the default's kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await parts.start(args)
    await stop.wait()
    await parts.stop(args)
    return 0


@dataclass(slots=True)
class _Parts:
    """A router process's servers and what they serve."""

    cluster: Cluster
    routing: Routing
    router: RouterServicer
    tracing: Tracing
    server: grpc.aio.Server
    health: object
    admin: grpc.aio.Server
    admin_health: object
    admin_host: str
    http: object | None
    collectors: list
    gc_pauses: GcPauses
    http_task: asyncio.Future | None = None

    async def start(self, args) -> None:
        # Metrics first: anything a launcher finds SERVING can be scraped.
        serve_metrics(args.metrics_port, args.host, self.collectors)
        await self.server.start()
        if self.http is not None:
            self.http_task = await _start_http(self.http, args, self.router.tls)
        await self.admin.start()
        # Start-up is over (tokenizer, servers): full collections skip it from now on.
        if args.gc_freeze:
            freeze_heap("router")
        self.gc_pauses.install()  # start-up's collections delay no stream: not timed
        await set_serving(self.health, [ROUTER], True)
        await set_serving(self.admin_health, [ADMIN], True)
        logger.info(
            "router serving on %s:%d (admin on %s:%d), routing policy %s",
            args.host,
            args.port,
            self.admin_host,
            args.admin_port,
            self.routing.config.policy.value,
        )

    async def stop(self, args) -> None:
        # NOT_SERVING at once; streams in flight get the drain timeout, new calls are refused.
        await set_serving(self.health, [ROUTER], False)
        logger.info("router stopping: %d streams in flight", self.routing.inflight.in_flight)
        if self.http is not None:
            self.http.should_exit = True  # stops accepting; streams get the same drain timeout
        await self.server.stop(grace=args.drain_timeout)
        if self.http_task is not None:
            await self.http_task
        await self.admin.stop(grace=1)
        await self.router.close()
        await self.routing.close()
        await self.cluster.close()
        self.tracing.shutdown()


async def _build(args: argparse.Namespace) -> _Parts:
    """Everything the router serves with, its ports bound, nothing started."""
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    # Security configuration first: a bad path or flag fails before any loading.
    tls = TLSConfig.from_args(args)
    redis_connection = redis_options_from_args(args)
    public_auth, admin_auth = router_interceptors(args.api_tokens_file, args.admin_token)
    # Before loading the tokenizer: a taken port is one line, at once.
    check_free(args.host, router_ports(args))
    config = _engine_config(args)
    route_config = routing_config(args)  # ValueError names a bad knob
    frontend = Frontend(config, args.trust_request_chat_template)
    cluster = Cluster.from_url(args.redis_url, redis_connection)
    await check_redis(cluster.redis, args.redis_url)
    routing = Routing(
        cluster,
        frontend.model_id,
        frontend.block_size,
        route_config,
        remote_prefill=not args.no_remote_prefill,
        served=frontend.served,
        numerics=frontend.numerics,
    )
    await routing.read_nodes()  # the nodes' context length, where they registered already
    tracing = Tracing("pdserve-router", args.otlp_endpoint, f"router:{args.port}")
    router = RouterServicer(
        frontend,
        routing,
        tls=tls,
        access_log=not args.no_access_log,
        tracing=tracing,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    server, health = await _public_server(args, router, public_auth, tls)
    admin_servicer = AdminServicer(cluster, routing, frontend, router.channel)
    admin, admin_health, admin_host = await _admin_server(args, admin_auth, admin_servicer, tls)
    gc_pauses = GcPauses()  # installed once serving
    collectors = [RouterCollector(routing), GcCollector(gc_pauses, {})]
    lora_updates = None
    if args.allow_runtime_lora_updating:
        lora_updates = (admin_servicer.lora, admin_auth[0] if admin_auth else None)
    http = _http_server(args, router, public_auth, collectors, tls, lora_updates)
    return _Parts(
        cluster, routing, router, tracing, server, health, admin, admin_health, admin_host,
        http, collectors, gc_pauses,
    )  # fmt: skip


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The model's tokenizer and limits, as the router checks requests against them."""
    kwargs = {"kvcache_block_size": args.kvcache_block_size}
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.skip_tokenizer_init:
        kwargs["skip_tokenizer_init"] = True
    return EngineConfig.from_kwargs(args.model, **kwargs)


async def _public_server(args, router: RouterServicer, public_auth, tls: TLSConfig):
    """The public gRPC API (not started) and its health service."""
    # Clients' mistakes get INVALID_ARGUMENT naming them, even those the servicer
    # never sees: oversized metadata, request bytes that do not parse (invalid UTF-8).
    server = grpc.aio.server(
        interceptors=[MetadataLimitInterceptor(), *public_auth], options=PUBLIC_SERVER_OPTIONS
    )
    add_lenient_servicer(server, ROUTER_SERVICE, router)
    health = await add_health(server, [ROUTER])
    if args.enable_reflection:
        add_reflection(server, [ROUTER])
    listen(server, args.host, args.port, "--port", "router public API", tls)
    return server, health


async def _admin_server(args, admin_auth, servicer: AdminServicer, tls: TLSConfig):
    """The admin API (not started), its health service and the host it listens on."""
    if admin_auth:
        admin = grpc.aio.server(interceptors=admin_auth)
        admin_host = args.host
    else:
        # No token: nobody beyond this host may drain or flush nodes.
        admin = grpc.aio.server()
        admin_host = "127.0.0.1"
        logger.warning("no --admin-token: the admin API listens on 127.0.0.1 only")
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, admin)
    admin_health = await add_health(admin, [ADMIN])
    listen(admin, admin_host, args.admin_port, "--admin-port", "router admin API", tls)
    return admin, admin_health, admin_host


def _http_server(
    args, router: RouterServicer, public_auth, collectors: list, tls: TLSConfig, lora_updates
):
    """The OpenAI API's server (not started), its collector added; None without --http-port."""
    if not args.http_port:
        return None
    from router.http import app as http_app  # FastAPI is imported only where the port is on

    http_stats = http_app.HttpStats()
    collectors.append(http_app.HttpCollector(http_stats))
    app = http_app.build_app(
        router,
        public_auth[0] if public_auth else None,
        http_stats,
        args.tool_call_parser,
        args.reasoning_parser,
        lora_updates,
    )
    return http_app.make_server(
        app, args.host, args.http_port, tls, args.drain_timeout, args.http_keep_alive_s
    )


async def _start_http(http, args, tls: TLSConfig) -> asyncio.Future:
    """Serve the OpenAI API; returns once it accepts connections."""
    http_task = asyncio.ensure_future(http.serve())
    while not http.started:  # serving before health says SERVING
        if http_task.done():
            http_task.result()  # the port is taken, etc.: fail as loudly as gRPC would
            raise RuntimeError(f"HTTP server on port {args.http_port} did not start")
        await asyncio.sleep(0.01)
    logger.info(
        "OpenAI API on http%s://%s:%d/v1", "s" if tls.serves_tls else "", args.host, args.http_port
    )
    return http_task
