"""`pdserve generate` failing: its error is the first line on stderr, no blank
line before it (pdserve/generate.py)."""

from __future__ import annotations

import subprocess
import sys

from pdserve.redis_server import free_port


def test_an_error_before_any_token_starts_on_the_first_line():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--address", address,
         "--timeout", "5", "Hello"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith("pdserve: error: UNAVAILABLE"), repr(out.stderr)
