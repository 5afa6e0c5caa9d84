"""`pdctl top`: a live full-screen view of the cluster (rich), refreshed each second.

Every node: role, load (running/waiting), usage bars of its KV pool and of
its host tier (``--swap-space``; "-" without one), queued prefill
tokens, requests/s, heartbeat age, draining; the router: TTFT/TPOT/ITL
percentiles, request and prompt-token rates, in flight. `q` (or Ctrl-C)
quits. Rates are differences between two polls of the admin API, so the
first frame shows none. `--once` prints one frame and exits (scripts, tests).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import threading
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from proto import admin_pb2

HEARTBEAT_STALE_MS = 2000  # older than this shows red: the node may be gone


@dataclass(slots=True)
class Sample:
    """One poll of the admin API."""

    at: float  # time.monotonic()
    nodes: list
    stats: admin_pb2.StatsResponse

    @property
    def requests_ended(self) -> int:
        return sum(c.count for c in self.stats.requests_by_status)


def poll(stub, call: dict) -> Sample:
    nodes = list(stub.ListNodes(admin_pb2.ListNodesRequest(), **call).nodes)
    stats = stub.Stats(admin_pb2.StatsRequest(), **call)
    return Sample(time.monotonic(), sorted(nodes, key=lambda n: (n.role, n.node_id)), stats)


def _rate(now: float, before: float, seconds: float) -> str:
    return f"{(now - before) / seconds:.1f}" if seconds > 0 else "-"


def usage_bar(total: int, free: int, width: int = 20) -> Text:
    """Used share of a block pool as a bar: green, yellow above 70%, red above 90%."""
    if not total:
        return Text("-")
    share = (total - free) / total
    filled = round(share * width)
    style = "red" if share > 0.9 else "yellow" if share > 0.7 else "green"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {share:4.0%}")
    return bar


def nodes_table(prev: Sample | None, cur: Sample) -> Table:
    t = Table(title="nodes", title_justify="left")
    bars = ("KV USAGE", "HOST USAGE")
    for name in ("NODE", "ROLE", "RUNNING", "WAITING", *bars, "QUEUED TOK", "REQ/S", "TOK/S"):
        t.add_column(name, justify="left" if name in ("NODE", "ROLE", *bars) else "right")
    t.add_column("HEARTBEAT", justify="right")
    t.add_column("DRAINING")
    before = {n.node_id: n for n in prev.nodes} if prev else {}
    seconds = cur.at - prev.at if prev else 0.0
    for n in cur.nodes:
        old = before.get(n.node_id)
        rate = _rate(n.requests_total, old.requests_total, seconds) if old else "-"
        # Tokens through the model: prompts on a prefill node, mostly decode steps on a decode node.
        tok_rate = (
            _rate(n.computed_tokens_total, old.computed_tokens_total, seconds) if old else "-"
        )
        age = Text(
            f"{n.heartbeat_age_ms} ms",
            style="red" if n.heartbeat_age_ms > HEARTBEAT_STALE_MS else "",
        )
        t.add_row(
            n.node_id,
            n.role,
            str(n.running),
            str(n.waiting),
            usage_bar(n.kv_blocks_total, n.kv_blocks_free),
            usage_bar(n.host_kv_blocks_total, n.host_kv_blocks_free, width=10),
            str(n.queued_prefill_tokens),
            rate,
            tok_rate,
            age,
            Text("yes", style="yellow") if n.draining else "no",
        )
    return t


def latency_table(s: admin_pb2.StatsResponse) -> Table:
    t = Table(title="router latency (ms)", title_justify="left")
    for name in ("", "COUNT", "P50", "P90", "P99", "MEAN"):
        t.add_column(name, justify="left" if not name else "right")
    for name, x in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        if x.count:
            t.add_row(
                name, str(x.count), *(f"{v:.1f}" for v in (x.p50_ms, x.p90_ms, x.p99_ms, x.mean_ms))
            )
        else:
            t.add_row(name, "0", "-", "-", "-", "-")
    return t


def summary(prev: Sample | None, cur: Sample, address: str) -> Text:
    s = cur.stats
    seconds = cur.at - prev.at if prev else 0.0
    req_rate = _rate(cur.requests_ended, prev.requests_ended, seconds) if prev else "-"
    tok_rate = _rate(s.prompt_tokens, prev.stats.prompt_tokens, seconds) if prev else "-"
    return Text(
        f"pdctl top  {address}  router up {s.uptime_s:.0f} s  |  requests/s {req_rate}  "
        f"prompt tok/s {tok_rate}  in flight {s.in_flight}  prefix hits {s.prefix_hit_rate:.1%}"
        "  |  q quits",
        style="bold",
    )


def render(prev: Sample | None, cur: Sample, address: str) -> Group:
    return Group(summary(prev, cur, address), nodes_table(prev, cur), latency_table(cur.stats))


# Columns for a frame printed where there is no terminal (a pipe, a file, a
# script): wide enough that no row wraps, so each node stays on one line.
UNWRAPPED_WIDTH = 10_000


def render_text(prev: Sample | None, cur: Sample, address: str, width: int | None = None) -> str:
    """One frame as plain text (what `--once` prints), ``width`` columns wide;
    None: as wide as its rows (no terminal to fit)."""
    console = Console(width=width or UNWRAPPED_WIDTH, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(prev, cur, address))
    return "".join(line.rstrip() + "\n" for line in console.export_text().splitlines())


@contextlib.contextmanager
def _keys():
    """A thread-safe event set when `q` is pressed (stdin in cbreak mode while
    inside); without a terminal, only Ctrl-C quits."""
    quit_ = threading.Event()
    if not sys.stdin.isatty():
        yield quit_
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield quit_
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _pressed_q(timeout: float) -> bool:
    if not sys.stdin.isatty():
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and sys.stdin.read(1).lower() == "q"


def cmd_top(stub, args) -> int:
    cur = poll(stub, args.call)
    if args.once:
        # Two polls a short interval apart, so the rates are real ones.
        time.sleep(min(args.interval, 1.0))
        prev, cur = cur, poll(stub, args.call)
        # A terminal's width where there is one; a pipe or a file gets whole rows.
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        sys.stdout.write(render_text(prev, cur, args.address, width))
        sys.stdout.flush()
        return 0
    prev = None
    with _keys(), Live(render(prev, cur, args.address), screen=True, auto_refresh=False) as live:
        while True:
            deadline = time.monotonic() + args.interval
            while (left := deadline - time.monotonic()) > 0:
                if _pressed_q(left):
                    return 0
            prev, cur = cur, poll(stub, args.call)
            live.update(render(prev, cur, args.address), refresh=True)


def add_top_parser(sub, parents) -> None:
    t = sub.add_parser("top", parents=parents, help="live view of nodes and latency (q quits)")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.set_defaults(func=cmd_top)
