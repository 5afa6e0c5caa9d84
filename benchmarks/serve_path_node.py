"""The processes of benchmarks/serve_path.py: a decode node with a timestamp at
each hop of a request, the router in front of it, Redis; and the GIL probe.

    SERVE_PATH_TRACE=trace.jsonl python benchmarks/serve_path_node.py decode --model DIR ...

runs the real decode node (its worker, servicer and engine thread, unchanged)
with three thin wrappers that note ``time.monotonic()`` (one clock for every
process on the host) as a request passes:

- received: the servicer's Decode handler starts;
- submitted: the worker hands the request to the engine thread (command queue);
- added: the engine thread runs the command that adds the request;
- scheduled, first_token: the engine's own metrics (first admitted into a
  batch; first token read on the host);
- sink: the engine thread hands the first output with a token to the loop;
- yielded: the loop has it as a message (the handler's generator yields it);
- written: the generator resumes, i.e. gRPC finished writing that message.

One JSON line per request goes to ``$SERVE_PATH_TRACE`` when its stream ends,
keyed by the prompt's last token ids (the router renames requests); the OS
thread ids of the loop and the engine thread to ``$SERVE_PATH_TRACE.threads.json``;
and the GIL probe's samples, a line a second, to ``$SERVE_PATH_TRACE.gil.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
TAIL = 8  # prompt tokens that identify a request across the router's renaming


class GilProbe:
    """A thread that sleeps ``period_s`` at a time and notes how much later than
    asked it runs again: what a thread that wakes up (the node's loop after a
    socket became readable, say) waits for the GIL, plus the OS's wake-up.
    ``on_second(samples)`` gets each second's lags, in microseconds."""

    def __init__(self, on_second, period_s: float = 0.002) -> None:
        self.on_second, self.period_s = on_second, period_s
        threading.Thread(target=self._run, name="gil-probe", daemon=True).start()

    def _run(self) -> None:
        lags: list[float] = []
        second = time.monotonic() + 1.0
        while True:
            t = time.perf_counter()
            time.sleep(self.period_s)
            lags.append((time.perf_counter() - t - self.period_s) * 1e6)
            if time.monotonic() >= second:
                self.on_second(lags)
                lags, second = [], second + 1.0


def install(trace_path: str) -> None:
    import decode_node.main as decode_main
    from decode_node.worker import DecodeWorker
    from engine.outputs import RequestOutput

    trace = open(trace_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    gil = open(f"{trace_path}.gil.jsonl", "a", buffering=1)  # noqa: SIM115
    GilProbe(lambda lags: gil.write(json.dumps({"t": time.monotonic(), "lags_us": lags}) + "\n"))
    records: dict[str, dict[str, float]] = {}

    class TracedThread:
        """The node's EngineThread, with ``add`` noting when the request is added
        and when its first token leaves the engine thread."""

        def __init__(self, thread) -> None:
            self._thread = thread

        def __getattr__(self, name: str):
            return getattr(self._thread, name)

        def add(self, request_id: str, sink, fn, **kwargs):
            rec = records.setdefault(request_id, {})

            def traced_fn(engine):
                rec["added"] = time.monotonic()
                return fn(engine)

            def traced_sink(item) -> None:
                if (
                    "sink" not in rec
                    and isinstance(item, RequestOutput)
                    and any(c.token_ids for c in item.outputs)
                ):
                    rec["sink"] = time.monotonic()
                    rec["scheduled"] = item.metrics.first_scheduled_time or 0.0
                    rec["first_token"] = item.metrics.first_token_time or 0.0
                sink(item)

            rec["submitted"] = time.monotonic()
            return self._thread.add(request_id, traced_sink, traced_fn, **kwargs)

    class TracedWorker(DecodeWorker):
        def __init__(self, node_id, engine, *args, **kwargs) -> None:
            super().__init__(node_id, engine, *args, **kwargs)
            self.engine = TracedThread(engine)
            # Which OS threads are the loop and the engine (their CPU time is in /proc).
            threads = {"loop": threading.get_native_id(), "engine": engine._thread.native_id}
            Path(f"{trace_path}.threads.json").write_text(json.dumps(threads))

        async def decode(self, request, deadline):
            # Stamped here, not in the servicer: a router's DecodeSession runs
            # this too. "written": the gRPC write of a Decode call's first token
            # returned; on a session, the message was queued for the session's batch.
            rid = request.request_id
            rec = records.setdefault(rid, {})
            rec["received"] = time.monotonic()
            try:
                async for response in super().decode(request, deadline):
                    first = "yielded" not in rec and any(d.token_ids for d in response.deltas)
                    if first:
                        rec["yielded"] = time.monotonic()
                    yield response
                    if first:
                        rec["written"] = time.monotonic()
            finally:
                records.pop(rid, None)
                tail = list(request.prompt_token_ids[-TAIL:])
                trace.write(json.dumps({"tail": tail, **rec}) + "\n")

    decode_main.DecodeWorker = TracedWorker


# ------------------------------------------------------------------ processes
def cpu_seconds(pid: int, tid: int = 0) -> float:
    """User + system CPU time of a process (tid 0) or one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if not tid else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runq_seconds(pid: int, tid: int) -> float:
    """How long a thread was ready to run but waited for a CPU (not for the GIL:
    a thread waiting for the GIL sleeps), from /proc's schedstat (0 where the
    kernel keeps none)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Cluster:
    """Redis, the traced decode node and the router (--no-remote-prefill), as
    processes of their own. ``engine`` is the node's engine flags."""

    def __init__(self, model_dir: Path, engine: list[str], logs: Path, env: dict) -> None:
        self.logs, self.procs = logs, []
        self.trace = logs / "node-trace.jsonl"
        self.redis = RedisServer().start()
        self.node_port, self.router_port = free_port(), free_port()
        common = ["--model", str(model_dir), "--host", "127.0.0.1", "--metrics-port", "0"]
        common += ["--redis-url", self.redis.url, "--skip-tokenizer-init"]
        node = [str(ROOT / "benchmarks" / "serve_path_node.py"), "decode", *common, *engine]
        node += ["--port", str(self.node_port), "--transfer-port", str(free_port())]
        node += ["--advertise-host", "127.0.0.1", "--node-id", "decode-0"]
        max_len = engine[engine.index("--max-model-len") + 1]
        router = ["-m", "pdserve.cli", "router", *common, "--no-remote-prefill"]
        router += ["--max-model-len", max_len]
        router += ["--port", str(self.router_port), "--admin-port", str(free_port())]
        self.node = self._spawn("node", node, env | {"SERVE_PATH_TRACE": str(self.trace)})
        self.router = self._spawn("router", router, env)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        # This tree first, and whatever else the caller's PYTHONPATH holds (a GPU
        # host's extra packages).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = os.environ | {"PYTHONPATH": path} | env
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    async def wait_ready(self, try_once, timeout_s: float) -> None:
        """Until ``try_once()`` (a request through the router) succeeds."""
        import grpc

        deadline = time.monotonic() + timeout_s
        while True:
            for proc, name in ((self.node, "node"), (self.router, "router")):
                if proc.poll() is not None:
                    raise RuntimeError(f"the {name} exited; see {self.logs / name}.log")
            try:
                return await try_once()
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)

    def threads(self) -> dict[str, tuple[int, int]]:
        """(pid, tid) of the node's loop and engine thread, and the processes whole (tid 0)."""
        ids = json.loads(Path(f"{self.trace}.threads.json").read_text())
        pid = self.node.pid
        return {
            "node_loop": (pid, ids["loop"]),
            "node_engine": (pid, ids["engine"]),
            "node": (pid, 0),
            "router": (self.router.pid, 0),
        }

    def node_records(self) -> dict[tuple[int, ...], dict[str, float]]:
        lines = self.trace.read_text().splitlines() if self.trace.exists() else []
        return {tuple(r.pop("tail")): r for r in map(json.loads, lines)}

    def gil_lags(self, start: float, end: float) -> list[float]:
        """The node's GIL probe samples (us) of the seconds that ended in [start, end]."""
        path = Path(f"{self.trace}.gil.jsonl")
        lines = path.read_text().splitlines() if path.exists() else []
        rows = (json.loads(line) for line in lines)
        return [lag for row in rows if start <= row["t"] <= end for lag in row["lags_us"]]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.stop()


def main() -> int:
    install(os.environ["SERVE_PATH_TRACE"])
    if switch_ms := os.environ.get("SERVE_PATH_SWITCH_INTERVAL_MS"):
        sys.setswitchinterval(float(switch_ms) / 1e3)  # the GIL's (an experiment)
    from pdserve.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
