"""What an active NVLink costs a power-capped GPU's compute: matmuls beside a trickle of peer copies.

    python benchmarks/nvlink_power.py                       # two GPUs of one host
    python benchmarks/nvlink_power.py --periods-ms 1.5,6,25,100 --seconds 5 --rounds 3

GPU 0 runs bf16 matmuls back to back (8192 cubed: power-capped on an H100 or
H200, so its SM clock is set by its power) while another thread copies 8 MiB
from GPU 0 every ``period`` ms, either to GPU 1 (over NVLink) or within GPU 0
(the same bytes through the same HBM, no link). Phases of ``--seconds`` each,
in rounds; each round's matmul-only phase is the baseline of the others in
that round. Before them, the same trickles with no compute, to show the
link's own power. Per phase: matmul TFLOP/s and its ratio to the baseline,
and nvidia-smi's median SM clock and power draw of both GPUs over the phase.

Why it is here: a KV stream sends a chunk after every layer of a prefill, so
the link is active for the whole forward (benchmarks/kv_send_paths.py
measured the forward slowing alike under NCCL sends and copy-engine copies).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import enable_peer_copies, save_run

SIZE = 8192  # matmul side
CHUNK_BYTES = 8 << 20  # one layer's KV of a 2048-token Llama-3.1-8B prompt


class SmiSampler:
    """nvidia-smi's SM clock and power of every GPU every 100 ms, in the background."""

    def __init__(self) -> None:
        cmd = [
            "nvidia-smi",
            "--query-gpu=index,timestamp,clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ]
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, text=True
            )
        except OSError:
            self.proc = None
        self.samples: list[tuple[int, float, float, float]] = []
        if self.proc is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        if self.proc is None or self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.strptime(parts[1], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((int(parts[0]), stamp, float(parts[2]), float(parts[3])))
            except (ValueError, IndexError):
                continue  # a GPU that reports "[N/A]"

    def between(self, gpu: int, t0: float, t1: float) -> dict[str, float]:
        """Median clock and power of one GPU over [t0, t1] (host clock, local time)."""
        inside = [s for s in self.samples if s[0] == gpu and t0 <= s[1] <= t1]
        if not inside:
            return {}
        return {
            f"gpu{gpu}_sm_mhz": statistics.median(s[2] for s in inside),
            f"gpu{gpu}_power_w": statistics.median(s[3] for s in inside),
        }

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)


class Rig:
    """GPU 0's matmul operands and the trickle's buffers, ready to run phases."""

    def __init__(self, seconds: float) -> None:
        import torch

        self.torch = torch
        self.seconds = seconds
        torch.cuda.set_device(0)
        enable_peer_copies()
        self.a = torch.randn(SIZE, SIZE, device="cuda:0", dtype=torch.bfloat16)
        self.b = torch.randn(SIZE, SIZE, device="cuda:0", dtype=torch.bfloat16)
        self.src = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda:0")
        self.targets = {
            "nvlink": torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda:1"),
            "local": torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda:0"),
        }
        self.xfer = torch.cuda.Stream(0)
        self.smi = SmiSampler()

    def _trickle(self, target: str, period_ms: float, stop: threading.Event) -> None:
        with self.torch.cuda.stream(self.xfer):
            while not stop.is_set():
                self.targets[target].copy_(self.src, non_blocking=True)
                time.sleep(period_ms / 1e3)

    def _matmuls(self) -> float:
        """20 matmuls back to back; their device time in ms."""
        torch = self.torch
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            torch.mm(self.a, self.b)
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    def phase(self, name: str, target: str | None, period_ms: float, compute: bool) -> dict:
        stop = threading.Event()
        thread = None
        if target is not None:
            thread = threading.Thread(target=self._trickle, args=(target, period_ms, stop))
        t0 = time.time()
        if thread:
            thread.start()
        count, device_ms = 0, 0.0
        while time.time() - t0 < self.seconds:
            if compute:
                device_ms += self._matmuls()
                count += 20
            else:
                time.sleep(0.05)
        stop.set()
        if thread:
            thread.join()
        self.torch.cuda.synchronize(0)
        t1 = time.time()
        row: dict[str, Any] = {"phase": name, "trickle": target, "period_ms": period_ms}
        row["tflops"] = 2 * SIZE**3 * count / (device_ms / 1e3) / 1e12 if count else None
        for gpu in (0, 1):  # the first and last half second are the transitions
            row.update(self.smi.between(gpu, t0 + 0.5, t1 - 0.2))
        return row


def run_rounds(rig: Rig, periods: list[float], rounds: int) -> list[dict[str, Any]]:
    """The no-compute phases, then per round the matmul baseline and each trickle."""
    rows = [
        rig.phase("idle", None, 0.0, False),
        rig.phase("nvlink trickle, no compute", "nvlink", periods[0], False),
        rig.phase("local trickle, no compute", "local", periods[0], False),
    ]
    rig.phase("matmul warm-up", None, 0.0, True)
    for r in range(rounds):
        base = rig.phase("matmul", None, 0.0, True)
        round_rows = [base]
        for period in periods:
            round_rows.append(
                rig.phase(f"matmul + nvlink every {period:g} ms", "nvlink", period, True)
            )
        round_rows.append(
            rig.phase(f"matmul + local every {periods[0]:g} ms", "local", periods[0], True)
        )
        for row in round_rows:
            row["round"] = r
            row["vs_matmul"] = row["tflops"] / base["tflops"]
        rows += round_rows
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--periods-ms", default="1.5,6,25,100,400", help="NVLink trickle periods")
    p.add_argument("--seconds", type=float, default=5.0, help="per phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("nvlink_power.py needs two GPUs")
    rig = Rig(args.seconds)
    try:
        rows = run_rounds(rig, [float(x) for x in args.periods_ms.split(",")], args.rounds)
    finally:
        rig.smi.stop()
    for row in rows:
        clock = f"{row.get('gpu0_sm_mhz', float('nan')):6.0f} MHz"
        power = " / ".join(f"{row.get(f'gpu{g}_power_w', float('nan')):5.1f} W" for g in (0, 1))
        perf = f"{row['tflops']:6.1f} TFLOP/s ({row['vs_matmul']:.4f})" if row["tflops"] else ""
        print(f"{row['phase']:34s} GPU 0 {clock}, power {power}  {perf}", flush=True)
    return save_run("nvlink_power", args, rows, argv)


if __name__ == "__main__":
    main()
