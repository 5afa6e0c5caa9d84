"""The committed gRPC stubs match the .proto files, and every proto field has a comment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROTOS = ["proto/pdserve.proto", "proto/internal.proto", "proto/admin.proto"]


def test_generated_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed")
    (tmp_path / "proto").mkdir()
    for p in PROTOS:
        (tmp_path / p).write_text((REPO / p).read_text())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            *PROTOS,
        ],
        cwd=tmp_path,
        check=True,
    )
    for generated in sorted((tmp_path / "proto").glob("*_pb2*.py*")):
        committed = REPO / "proto" / generated.name
        assert committed.is_file(), f"{generated.name} is not committed: run `make proto`"
        assert committed.read_text() == generated.read_text(), (
            f"{generated.name} is stale: run `make proto`"
        )


@pytest.mark.parametrize("path", PROTOS)
def test_every_field_has_a_comment(path):
    lines = (REPO / path).read_text().splitlines()
    field = re.compile(r"^\s+(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
    for i, line in enumerate(lines):
        if field.match(line):
            assert lines[i - 1].strip().startswith("//"), (
                f"{path}:{i + 1} has no comment: {line.strip()}"
            )
