"""The layout's rules (docs/architecture.md, "Layout"), checked on the source.

engine <- common <- {prefill_node, decode_node, router} <- pdserve, with proto
at the bottom beside engine: nothing imports upward or sideways, type-only
imports included; no two modules import each other, directly or in a circle.
Sizes follow seams: no function is longer than MAX_FUNCTION_LINES (a longer one
is split into named steps, not into files; the few exceptions are listed below
with their reason), and no file longer than MAX_FILE_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "common", "prefill_node", "decode_node", "router", "pdserve", "proto")
# What each package may import of the others (itself always).
ALLOWED = {
    "proto": set(),
    "engine": set(),
    "common": {"engine", "proto"},
    "prefill_node": {"engine", "common", "proto"},
    "decode_node": {"engine", "common", "proto"},
    "router": {"engine", "common", "proto"},
    "pdserve": {"engine", "common", "proto", "prefill_node", "decode_node", "router"},
}
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 60
# Functions allowed past MAX_FUNCTION_LINES, by module:qualified name, and why.
LONG_FUNCTIONS = {
    "engine.layers.attention.triton_prefill_split:_prefill_split_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "engine.layers.attention.triton_prefill_split:_prefill_merge_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "engine.layers.attention.triton_decode:_decode_split_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "engine.layers.attention.triton_kernels:_prefill_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "engine.layers.attention.triton_kernels:_attend_key_tile": (
        "a Triton function inlined into its kernel: one key tile's online softmax"
    ),
    "engine.layers.moe.fused_moe:_fused_moe_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "engine.layers.fused_kernels:_rope_qk_kernel": (
        "one Triton program: q and k rotated and stored in one launch"
    ),
    "engine.layers.skinny_gemm_kernels:_skinny_gemm_kernel": (
        "one Triton program: its loop carries registers a helper call cannot"
    ),
    "pdserve.cli:build_parser": "a flat list of subcommands and their flags",
    "router.main:add_arguments": "a flat list of flag declarations",
    "common.runtime.config:add_node_arguments": "a flat list of flag declarations",
    "pdserve.bench.cli:add_serve_arguments": "a flat list of flag declarations",
}


def _source_files() -> list[Path]:
    files = []
    for pkg in PACKAGES:
        files += [
            p
            for p in (REPO / pkg).rglob("*.py")
            if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        ]
    return sorted(files)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str) -> str | None:
    """The first-party module ``name`` refers to (a module or a package), or None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return name
    return None


def _imports(path: Path) -> set[str]:
    """Every first-party module the file imports, anywhere in it (functions and
    ``if TYPE_CHECKING:`` blocks too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (mod := _resolve(alias.name)) is not None:
                    out.add(mod)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                # ``from a.b import c`` names module a.b.c when there is one.
                mod = _resolve(f"{node.module}.{alias.name}") or _resolve(node.module)
                if mod is not None:
                    out.add(mod)
    return out


GRAPH = {_module_name(p): _imports(p) for p in _source_files()}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_runs_up_or_sideways(pkg):
    wrong = sorted(
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if mod.split(".")[0] == pkg
        for dep in deps
        if dep.split(".")[0] not in ALLOWED[pkg] | {pkg}
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in GRAPH[v]:
                cycles.append(sorted(scc))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_what_it_checks():
    # The rules above mean something only if the graph and the functions are read right.
    assert FUNCTIONS["common.runtime.node:run_node"] > 20
    assert "router.service:RouterServicer.generate" in FUNCTIONS
    assert "engine.llm_engine" in GRAPH["engine.engine_thread"]
    assert "engine.layers.attention" in GRAPH["engine.model_runner"]
    assert "common.cluster.state" in GRAPH["router.routing"]
    assert "router.main" in GRAPH["pdserve.cli"]  # imported inside a function
    assert "common.runtime.heartbeat" in GRAPH["common.metrics.node"]  # a type-only import


def test_engine_imports_without_torch():
    # The router uses the engine's torch-free parts (validation, hashing) and
    # never loads torch itself.
    import subprocess
    import sys

    code = (
        "import sys, engine, engine.config, engine.input_processor, engine.block_hash, "
        "engine.sampling_params, engine.scheduler, router.frontend, router.main; "
        "sys.exit('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr or "importing the router's engine parts imported torch"


def test_no_source_file_is_too_long():
    extra = [p for d in ("benchmarks",) for p in (REPO / d).rglob("*.py")]
    long = sorted(
        f"{p.relative_to(REPO)}: {n} lines"
        for p in _source_files() + extra
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    )
    assert not long, "\n".join(long)


def _functions(path: Path):
    """(qualified name, lines) of every function and method in a file."""

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - child.lineno + 1
                yield from visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(ast.parse(path.read_text(), str(path)), "")


FUNCTIONS = {
    f"{_module_name(p)}:{name}": lines for p in _source_files() for name, lines in _functions(p)
}


def test_no_function_is_too_long():
    long = sorted(
        f"{name}: {lines} lines"
        for name, lines in FUNCTIONS.items()
        if lines > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS
    )
    assert not long, "split into named steps:\n" + "\n".join(long)


def test_every_listed_exception_still_needs_to_be_one():
    stale = sorted(name for name in LONG_FUNCTIONS if FUNCTIONS.get(name, 0) <= MAX_FUNCTION_LINES)
    assert not stale, f"no longer long (or gone): take them off LONG_FUNCTIONS: {stale}"
