"""benchmarks/gemv_tuning.py's CPU parts (``tune_kernels.py --part gemv``): the
shapes it tunes and the table it writes, read back the way the engine's plan
reads it (the timing itself needs a GPU); and that the suite hands that part
its own options."""

from __future__ import annotations

from benchmarks.gemv_tuning import merge_table, projection_shapes, tile_candidates
from engine.layers.skinny_gemm import GemvConfig
from engine.layers.skinny_gemm_plan import choose, load_table
from engine.layers.specs import GemvBackend


def test_projection_shapes_of_the_tuned_models():
    assert projection_shapes("qwen3-0.6b") == {
        "qkv_proj": (4096, 1024),
        "o_proj": (1024, 2048),
        "gate_up_proj": (6144, 1024),
        "down_proj": (1024, 3072),
    }
    assert projection_shapes("llama-3.1-8b") == {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336),
    }


def test_candidates_use_the_tensor_core_tile_above_four_tokens():
    assert not any(c.use_dot for c in tile_candidates(1))
    assert all(c.use_dot for c in tile_candidates(16))
    assert {c.use_dot for c in tile_candidates(8)} == {True, False}


def test_the_written_table_is_what_the_plan_reads(tmp_path):
    path = tmp_path / "GPU.json"
    fast = GemvConfig(16, 512, 1, 4, 3, False)
    slow = GemvConfig(32, 256, 2, 4, 3, False)
    rows = [
        {
            "n": 4096,
            "k": 1024,
            "m": 1,
            "config": fast.to_dict(),
            "triton_us": 3.0,
            "cublas_us": 5.0,
        },
        {
            "n": 4096,
            "k": 1024,
            "m": 2,
            "config": slow.to_dict(),
            "triton_us": 6.0,
            "cublas_us": 5.0,
        },
    ]
    merge_table(path, "bfloat16", rows)
    merge_table(path, "bfloat16", [{**rows[0], "m": 4}])  # a later run adds, keeps the rest
    table = load_table(path)["bfloat16"]["4096x1024"]
    assert sorted(table) == ["1", "2", "4"]
    assert choose(table["1"], GemvBackend.AUTO) == (True, fast)
    assert choose(table["2"], GemvBackend.AUTO) == (True, None)  # cuBLAS was faster
    assert choose(table["2"], GemvBackend.TRITON) == (True, slow)


def test_the_gemv_part_gets_every_option_after_it(monkeypatch):
    """``tune_kernels.py --part gemv`` passes the skinny GEMM's own options (and
    --out-dir) through untouched, and records the suite's command line."""
    from benchmarks import gemv_tuning, tune_kernels

    seen = {}
    monkeypatch.setattr(
        gemv_tuning, "main", lambda argv, command: seen.update(argv=argv, cmd=command)
    )
    argv = ["--part", "gemv", "--write-table", "--m", "1,2", "--out-dir", "/tmp/x"]
    tune_kernels.main(argv)
    assert seen["argv"] == ["--write-table", "--m", "1,2", "--out-dir", "/tmp/x"]
    assert seen["cmd"] == "python benchmarks/tune_kernels.py " + " ".join(argv)
