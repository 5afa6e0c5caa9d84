"""The ``quantization`` option and checkpoint quantization_config parsing
(engine/quantization/scheme.py), the FP8 capability check, and the
quantization block-hash extra key."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_prompt_blocks, quantization_extra_key
from engine.quantization.scheme import (
    CheckpointQuant,
    Quantization,
    ScaleLayout,
    parse_checkpoint_quant,
    parse_quantization,
    resolve_quantization,
)


def _ct(strategy="channel", acts=True, fmt="float-quantized", **weights):
    group = {
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": strategy, **weights},
        "input_activations": (
            {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True} if acts else None
        ),
    }
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g0": group}}


def test_unknown_quantization_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"'fp8', 'compressed-tensors'.*got 'int4'"):
        parse_quantization("int4")
    assert parse_quantization("fp8") is Quantization.FP8
    assert parse_quantization(None) is None


@pytest.mark.parametrize(
    ("qc", "want"),
    [
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            CheckpointQuant(
                Quantization.FP8, ScaleLayout.TENSOR, ("weight_scale", "weight_scale_inv")
            ),
        ),
        (
            {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
            CheckpointQuant(Quantization.FP8, ScaleLayout.BLOCK, ("weight_scale_inv",), (128, 128)),
        ),
        (
            _ct("channel"),
            CheckpointQuant(
                Quantization.COMPRESSED_TENSORS, ScaleLayout.CHANNEL, ("weight_scale",)
            ),
        ),
        (
            _ct("tensor"),
            CheckpointQuant(Quantization.COMPRESSED_TENSORS, ScaleLayout.TENSOR, ("weight_scale",)),
        ),
    ],
)
def test_checkpoint_formats_parse(qc, want):
    assert parse_checkpoint_quant(qc) == want


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq'.*supported: fp8"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two"),
        (_ct(fmt="int-quantized"), r"format \['int-quantized'\].*'float-quantized'"),
        (_ct(acts=False), r"weight-only FP8"),
        (_ct("group"), r"strategy 'group'"),
    ],
)
def test_unsupported_checkpoint_formats_name_the_field(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_checkpoint_quant(qc)


def test_the_checkpoint_decides_and_a_mismatch_is_refused():
    ct = parse_checkpoint_quant(_ct())
    assert resolve_quantization(None, ct) is Quantization.COMPRESSED_TENSORS
    assert resolve_quantization(None, None) is None
    assert resolve_quantization(Quantization.FP8, None) is Quantization.FP8
    with pytest.raises(ValueError, match=r"quantization='fp8' does not match.*compressed-tensors"):
        resolve_quantization(Quantization.FP8, ct)
    with pytest.raises(ValueError, match=r"needs a compressed-tensors checkpoint"):
        resolve_quantization(Quantization.COMPRESSED_TENSORS, None)


def test_a_gpu_without_fp8_is_refused_naming_its_capability():
    from engine.quantization.fp8 import check_fp8_capability

    with pytest.raises(ValueError, match=r">= 8\.9; NVIDIA A100 has compute capability 8\.0"):
        check_fp8_capability((8, 0), "NVIDIA A100")
    check_fp8_capability((8, 9), "NVIDIA L4")
    check_fp8_capability((9, 0), "NVIDIA H100")


def test_quantized_blocks_hash_apart_and_unquantized_ones_keep_their_digests():
    ids = list(range(64))
    plain = hash_prompt_blocks(ids, "m", 16)
    assert hash_prompt_blocks(ids, "m", 16, extra_keys=()) == plain
    fp8 = hash_prompt_blocks(ids, "m", 16, extra_keys=(quantization_extra_key("fp8"),))
    assert quantization_extra_key("fp8") == "quantization=fp8"
    assert len(fp8) == len(plain) == 4
    assert not set(fp8) & set(plain)
