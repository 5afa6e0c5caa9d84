"""How `pdserve up` shares a CPU host's cores among its engine processes."""

from __future__ import annotations

import pytest

from engine.tp_workers import threads_per_rank
from pdserve.threads import THREAD_VARS, plan_threads


def test_a_cpu_host_shares_its_cores_among_the_engine_processes():
    plan = plan_threads(None, engine_processes=2, gpus=0, environ={}, cores=2)
    assert plan.env == dict.fromkeys(THREAD_VARS, "1")
    assert "2 cores shared by 2 engine processes" in plan.reason
    assert plan_threads(None, 3, 0, {}, cores=16).env["OMP_NUM_THREADS"] == "5"
    assert plan_threads(None, 8, 0, {}, cores=2).env["OMP_NUM_THREADS"] == "1"  # at least 1


def test_the_flag_wins_then_the_users_omp_num_threads_then_gpus_keep_torchs_default():
    assert plan_threads(3, 2, 0, {"OMP_NUM_THREADS": "7"}, cores=2).env["OMP_NUM_THREADS"] == "3"
    kept = plan_threads(None, 2, 0, {"OMP_NUM_THREADS": "7"}, cores=2)
    assert kept.env == {} and "7 (OMP_NUM_THREADS)" in kept.reason  # inherited untouched
    assert plan_threads(0, 2, 0, {}, cores=2).env == {}
    assert plan_threads(None, 2, 8, {}, cores=64).env == {}
    with pytest.raises(ValueError, match="--cpu-threads"):
        plan_threads(-1, 2, 0, {})


def test_a_tensor_parallel_rank_keeps_the_share_it_was_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_per_rank(2) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(1) >= 1
