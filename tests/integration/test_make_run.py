"""`make run` as a user runs it, on ports of its own (issue 50, item 4): ARGS
reach `pdserve up` and win over the Makefile's defaults, and PDSERVE_*
variables given to make reach it too. Ctrl-C (SIGINT to make's process group,
as a terminal sends it) stops everything.

The venv is not rebuilt here (``-o`` its stamp): `make setup` is the one
target that would install packages.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.redis_server import free_port
from tests.faults.harness import request, run

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent


def test_make_run_takes_args_and_pdserve_variables(tmp_path):
    stamp = VENV / ".setup-done"
    if not stamp.exists():
        pytest.skip(f"no {stamp}: this venv was not made by `make setup`")
    port, admin, http = free_port(), free_port(), free_port()
    args = f"--port {port} --http-port {http} --metrics-port 0 --log-dir {tmp_path}"
    proc = subprocess.Popen(
        ["make", "-o", str(stamp), "run", f"VENV={VENV}", f"ARGS={args}"]
        + [f"PDSERVE_ADMIN_PORT={admin}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as in a terminal
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        ready = f"router listening on 127.0.0.1:{port} (admin API on 127.0.0.1:{admin})"
        deadline = time.monotonic() + 400
        while not any(ready in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert any(f"OpenAI API on http://127.0.0.1:{http}/v1" in line for line in lines)
        outcome = run(f"127.0.0.1:{port}", request("Hello", max_tokens=4), timeout=120)
        assert outcome.code is grpc.StatusCode.OK, outcome.details
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == "smollm2-135m-instruct"
        pids = [int(m.group(1)) for line in lines if (m := re.search(r"\(pid (\d+)", line))]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    reader.join(10)
    assert any(line.strip() == "stopping..." for line in lines), "".join(lines)
    for pid in pids:  # every component stopped with it
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            assert time.monotonic() < deadline, f"pid {pid} still running"
            time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return "Z"
