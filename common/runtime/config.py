"""What both node kinds run with: their flags (and PDSERVE_* variables), the
engine's options among them, read once into a ``NodeConfig``."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from common.cluster.redis_auth import add_redis_auth_arguments, redis_options_from_args
from common.metrics.server import add_metrics_arguments
from common.runtime.env_switch import env_switch
from common.runtime.gc_heap import add_gc_arguments
from common.runtime.progress_log import DEFAULT_INTERVAL_S as DEFAULT_STATS_INTERVAL_S
from common.runtime.reliability import FAULT_DELAYS_ENV, FaultDelays
from common.tls import TLSConfig, add_tls_arguments
from common.tracing import add_tracing_arguments
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Engine options a node takes from its command line (EngineConfig names).
ENGINE_FLAGS: dict[str, type] = {
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "kvcache_block_size": int,
    "num_kvcache_blocks": int,
    "gpu_memory_utilization": float,
    "dtype": str,
    "quantization": str,
    "device": str,
    "attention_backend": str,
    "gemv_backend": str,
    "served_model_name": str,
    "seed": int,
    "load_format": str,
    "tensor_parallel_size": int,
    "swap_space": float,
    "cpu_offload_gb": float,
    "kv_cache_dtype": str,
    "preemption_mode": str,
    "max_loras": int,
    "max_lora_rank": int,
    "max_cpu_loras": int,
}


# Engine options that are on/off switches (--x / --no-x; unset: the engine decides).
ENGINE_SWITCHES: dict[str, str] = {
    "async_scheduling": "prepare step N+1 while the GPU runs step N (default: on with CUDA); "
    "with --late-launch (the default) a new request's first token comes as soon as with "
    "it off, which costs throughput (docs/lab/2026-11-25-late-launch.md)",
    "late_launch": "with async scheduling, build the next step just before the GPU ends "
    "the one in flight, so requests that arrived meanwhile join it (default: on)",
    "piecewise_cuda_graphs": "steps with prefill rows replay CUDA graphs of the layers' "
    "dense parts, attention eager between them (CUDA, one rank, triton backend; default on)",
}


# Engine options read PDSERVE_<OPTION>, except the block size: the router has
# always read PDSERVE_BLOCK_SIZE, and sharing its names (that one,
# PDSERVE_SERVED_MODEL_NAME, PDSERVE_MAX_MODEL_LEN) lets one setting (a
# Kubernetes ConfigMap, say) give the router and the nodes the same value.
_ENGINE_ENV = {"kvcache_block_size": "PDSERVE_BLOCK_SIZE"}


def engine_env_name(name: str) -> str:
    """The environment variable that sets engine option ``name`` (ENGINE_FLAGS or a switch)."""
    return _ENGINE_ENV.get(name, f"PDSERVE_{name.upper()}")


def add_engine_flags(parser: Any) -> None:
    env = os.environ.get
    for name, kind in ENGINE_FLAGS.items():
        var = engine_env_name(name)
        # An empty value counts as unset. A string default goes through `type`,
        # so a bad value is reported like a bad flag.
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=env(var) or None, help=f"[{var}]"
        )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=env(engine_env_name("enforce_eager")) == "1" or None,
        help="[PDSERVE_ENFORCE_EAGER=1]",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        default=env(engine_env_name("enable_lora")) == "1" or None,
        help="serve LoRA adapters (docs/engine.md, LoRA adapters) [PDSERVE_ENABLE_LORA=1]",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=(env("PDSERVE_LORA_MODULES") or "").split() or None,
        help="PEFT adapters to load at start (needs --enable-lora), their ids 1, 2, ... in "
        "this order [PDSERVE_LORA_MODULES, space-separated]",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=env(engine_env_name("skip_tokenizer_init")) == "1" or None,
        help="no tokenizer: token ids in, token ids out (dummy-weight models) "
        "[PDSERVE_SKIP_TOKENIZER_INIT=1]",
    )
    for name, help_text in ENGINE_SWITCHES.items():
        var = engine_env_name(name)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            action=argparse.BooleanOptionalAction,
            default=env_switch(var),
            help=f"{help_text} [{var}=1|0]",
        )


def engine_kwargs(args: Any) -> dict[str, Any]:
    out = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n, None) is not None}
    for flag in ("enforce_eager", "skip_tokenizer_init", "enable_lora"):
        if getattr(args, flag, None):
            out[flag] = True
    for switch in ENGINE_SWITCHES:
        if getattr(args, switch, None) is not None:
            out[switch] = getattr(args, switch)
    return out


@dataclass(slots=True, frozen=True)
class NodeConfig:
    """A node's settings, checked once at start-up (``from_args``), passed
    instead of the parsed flags."""

    model: str  # the HF model directory
    host: str  # listen address
    port: int  # gRPC port
    advertise_host: str  # the address other processes reach this node at
    node_id: str | None  # None: derived from the role, host and port
    redis_url: str
    redis_options: dict[str, Any]  # credentials and TLS for redis-py (cluster/redis_auth.py)
    tls: TLSConfig  # every gRPC hop's
    heartbeat_interval_s: float
    node_ttl_s: float
    log_stats_interval_s: float  # 0: no progress lines
    transfer_timeout_s: float  # a KV group's chunks under way
    kv_connect_timeout_s: float  # building a KV channel once both ends are there
    drain_timeout_s: float
    max_queued_requests: int  # 0: no bound
    verify_kv: bool
    enable_reflection: bool
    metrics_port: int
    gc_freeze: bool
    otlp_endpoint: str | None
    engine: dict[str, Any]  # EngineConfig options (vLLM's names)
    lora_modules: tuple[LoRARequest, ...] = ()  # adapters loaded at start

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeConfig:
        """From ``add_node_arguments``'s flags; ValueError for what cannot run."""
        if not args.model:
            raise ValueError("--model (or PDSERVE_MODEL) is required")
        if args.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
        return cls(
            model=args.model,
            host=args.host,
            port=args.port,
            advertise_host=args.advertise_host or default_host(),
            node_id=args.node_id,
            redis_url=args.redis_url,
            redis_options=redis_options_from_args(args),
            tls=TLSConfig.from_args(args),
            heartbeat_interval_s=args.heartbeat_interval,
            node_ttl_s=args.node_ttl,
            log_stats_interval_s=args.log_stats_interval,
            transfer_timeout_s=args.transfer_timeout,
            kv_connect_timeout_s=args.kv_connect_timeout,
            drain_timeout_s=args.drain_timeout,
            max_queued_requests=args.max_queued_requests,
            verify_kv=args.verify_kv,
            enable_reflection=args.enable_reflection,
            metrics_port=args.metrics_port,
            gc_freeze=args.gc_freeze,
            otlp_endpoint=args.otlp_endpoint,
            engine=engine_kwargs(args),
            lora_modules=lora_modules(getattr(args, "lora_modules", None), args.enable_lora),
        )


def lora_modules(values: list[str] | None, enable_lora: bool | None) -> tuple[LoRARequest, ...]:
    """``--lora-modules name=path ...`` (vLLM's flag) as LoRARequests, ids 1..n."""
    if not values:
        return ()
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    out: list[LoRARequest] = []
    for i, value in enumerate(values, start=1):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items; got {value!r}")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        out.append(LoRARequest(name, i, path))
    return tuple(out)


def fault_delays(node_id: str) -> FaultDelays:
    """The fault-injection delays (tests/faults only), loudly."""
    faults = FaultDelays.from_env()
    if faults:
        logger.warning("%s: fault injection on (%s)", node_id, os.environ[FAULT_DELAYS_ENV])
    return faults


def default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def add_node_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """Flags (and their PDSERVE_* variables) that prefill and decode nodes share."""
    env = os.environ.get
    p.add_argument(
        "--model", default=env("PDSERVE_MODEL"), help="HF model directory [PDSERVE_MODEL]"
    )
    p.add_argument(
        "--host", default=env("PDSERVE_HOST", "0.0.0.0"), help="listen address [PDSERVE_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env("PDSERVE_PORT", str(default_port))),
        help="gRPC port [PDSERVE_PORT]",
    )
    p.add_argument(
        "--advertise-host",
        default=env("PDSERVE_ADVERTISE_HOST"),
        help="host other nodes reach this one at [PDSERVE_ADVERTISE_HOST; default: this host's address]",
    )
    p.add_argument(
        "--node-id", default=env("PDSERVE_NODE_ID"), help="id in the registry [PDSERVE_NODE_ID]"
    )
    p.add_argument(
        "--redis-url",
        default=env("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="cluster state [PDSERVE_REDIS_URL]",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=float(env("PDSERVE_HEARTBEAT_S", "0.5")),
        help="seconds between heartbeats to Redis [PDSERVE_HEARTBEAT_S]",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=float(env("PDSERVE_LOG_STATS_INTERVAL_S", str(DEFAULT_STATS_INTERVAL_S))),
        help="seconds between progress lines while busy (tok/s, queue, KV); 0: none "
        "[PDSERVE_LOG_STATS_INTERVAL_S]",
    )
    p.add_argument(
        "--node-ttl",
        type=float,
        default=float(env("PDSERVE_NODE_TTL_S", "5")),
        help="seconds a node stays registered after its last heartbeat [PDSERVE_NODE_TTL_S]",
    )
    p.add_argument(
        "--transfer-timeout",
        type=float,
        default=float(env("PDSERVE_TRANSFER_TIMEOUT_S", "30")),
        help="seconds each KV chunk of a transfer under way may take [PDSERVE_TRANSFER_TIMEOUT_S]",
    )
    p.add_argument(
        "--kv-connect-timeout",
        type=float,
        default=float(env("PDSERVE_KV_CONNECT_TIMEOUT_S", "5")),
        help="seconds each side of a new KV channel waits in its rendezvous once the prefill "
        "node announced itself; apart from --transfer-timeout [PDSERVE_KV_CONNECT_TIMEOUT_S]",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("PDSERVE_DRAIN_TIMEOUT_S", "30")),
        help="on SIGTERM, seconds to let in-flight requests finish (a second signal: "
        "stop now) [PDSERVE_DRAIN_TIMEOUT_S]",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=int(env("PDSERVE_MAX_QUEUED_REQUESTS", "256")),
        help="requests waiting for the engine beyond which new ones get RESOURCE_EXHAUSTED "
        "(0: no bound) [PDSERVE_MAX_QUEUED_REQUESTS]",
    )
    p.add_argument(
        "--verify-kv",
        action="store_true",
        default=env("PDSERVE_VERIFY_KV") == "1",
        help="checksum every KV transfer on both sides (slow; for tests) [PDSERVE_VERIFY_KV=1]",
    )
    p.add_argument(
        "--enable-reflection",
        action="store_true",
        default=env("PDSERVE_REFLECTION") == "1",
        help="gRPC server reflection [PDSERVE_REFLECTION=1]",
    )
    add_metrics_arguments(p)
    add_tracing_arguments(p)
    add_gc_arguments(p)
    add_tls_arguments(p)
    add_redis_auth_arguments(p)
    add_engine_flags(p)
