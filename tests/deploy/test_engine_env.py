"""Engine options of `pdserve prefill|decode` from PDSERVE_* variables (what the
Kubernetes ConfigMaps set), and the router reading the shared ones."""

from __future__ import annotations

import pytest

from common.runtime.config import ENGINE_FLAGS, engine_env_name, engine_kwargs
from tests.deploy.k8s import parse_component


def test_every_engine_flag_has_a_variable():
    names = {engine_env_name(n) for n in [*ENGINE_FLAGS, "enforce_eager", "skip_tokenizer_init"]}
    assert len(names) == len(ENGINE_FLAGS) + 2
    # Shared with the router, which has read this name all along.
    assert engine_env_name("kvcache_block_size") == "PDSERVE_BLOCK_SIZE"


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_variables_set_engine_options_and_flags_win(component):
    env = {
        "PDSERVE_MAX_NUM_SEQS": "8",
        "PDSERVE_BLOCK_SIZE": "32",
        "PDSERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "PDSERVE_DEVICE": "cpu",
        "PDSERVE_NUM_KVCACHE_BLOCKS": "",  # empty: the engine's default
        "PDSERVE_ENFORCE_EAGER": "1",
    }
    ns, read = parse_component(component, ["--max-num-seqs", "4"], env)
    assert engine_kwargs(ns) == {
        "max_num_seqs": 4,
        "kvcache_block_size": 32,
        "gpu_memory_utilization": 0.5,
        "device": "cpu",
        "enforce_eager": True,
    }
    assert set(env) <= read


def test_no_variables_means_the_engine_defaults():
    ns, _ = parse_component("decode", [], {})
    assert engine_kwargs(ns) == {}


def test_a_bad_value_is_refused_like_a_bad_flag():
    with pytest.raises(pytest.fail.Exception, match="invalid int value"):
        parse_component("prefill", [], {"PDSERVE_MAX_NUM_SEQS": "many"})


def test_router_shares_block_size_and_max_model_len():
    ns, _ = parse_component(
        "router", [], {"PDSERVE_BLOCK_SIZE": "32", "PDSERVE_MAX_MODEL_LEN": "4096"}
    )
    assert (ns.kvcache_block_size, ns.max_model_len) == (32, 4096)
    ns, _ = parse_component("router", [], {"PDSERVE_MAX_MODEL_LEN": ""})
    assert ns.max_model_len is None


def test_async_scheduling_by_flag_or_variable():
    ns, _ = parse_component("decode", ["--no-async-scheduling"], {})
    assert engine_kwargs(ns) == {"async_scheduling": False}
    ns, _ = parse_component("prefill", [], {"PDSERVE_ASYNC_SCHEDULING": "1"})
    assert engine_kwargs(ns) == {"async_scheduling": True}
    ns, _ = parse_component("decode", ["--no-async-scheduling"], {"PDSERVE_ASYNC_SCHEDULING": "1"})
    assert engine_kwargs(ns) == {"async_scheduling": False}  # the flag wins


def test_late_launch_by_flag_or_variable():
    ns, _ = parse_component("decode", ["--no-late-launch"], {})
    assert engine_kwargs(ns) == {"late_launch": False}
    ns, _ = parse_component("prefill", [], {"PDSERVE_LATE_LAUNCH": "0"})
    assert engine_kwargs(ns) == {"late_launch": False}
    ns, _ = parse_component("decode", ["--late-launch"], {"PDSERVE_LATE_LAUNCH": "0"})
    assert engine_kwargs(ns) == {"late_launch": True}  # the flag wins
    ns, _ = parse_component("decode", [], {})
    assert "late_launch" not in engine_kwargs(ns)  # the engine's default (on)


def test_piecewise_cuda_graphs_by_flag_or_variable():
    ns, _ = parse_component("decode", ["--piecewise-cuda-graphs"], {})
    assert engine_kwargs(ns) == {"piecewise_cuda_graphs": True}
    ns, _ = parse_component("prefill", [], {"PDSERVE_PIECEWISE_CUDA_GRAPHS": "1"})
    assert engine_kwargs(ns) == {"piecewise_cuda_graphs": True}
    ns, _ = parse_component("decode", ["--no-piecewise-cuda-graphs"], {})
    assert engine_kwargs(ns) == {"piecewise_cuda_graphs": False}


def test_a_bad_switch_value_is_a_configuration_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse_component("decode", [], {"PDSERVE_ASYNC_SCHEDULING": "yes"})
    assert info.value.code == 2
    assert "PDSERVE_ASYNC_SCHEDULING must be 1 or 0" in capsys.readouterr().err


def test_gc_freeze_by_flag_or_variable():
    for component in ("decode", "prefill", "router"):
        ns, read = parse_component(component, [], {})
        assert ns.gc_freeze is True and "PDSERVE_GC_FREEZE" in read
        ns, _ = parse_component(component, [], {"PDSERVE_GC_FREEZE": "0"})
        assert ns.gc_freeze is False
        ns, _ = parse_component(component, ["--gc-freeze"], {"PDSERVE_GC_FREEZE": "0"})
        assert ns.gc_freeze is True  # the flag wins
