"""FP8 W8A8 linear layers: e4m3 weights with one scale per output channel,
activations quantized per token at run time.

``Fp8Linear`` replaces ``SkinnyLinear`` in every projection of a quantized
model (q/k/v, o, gate/up, down); the embedding and the LM head stay in the
model's dtype, as vLLM keeps them. Its matmul is ``fp8_gemm``: on a CUDA GPU
of compute capability 8.9 or more, ``torch._scaled_mm`` (cuBLASLt) with
row-wise scales (the activations' (M, 1), the weight's (1, N)); elsewhere,
and for shapes cuBLASLt refuses (a dimension not a multiple of 16), the
reference ``fp8_gemm_reference``: the FP8 values multiplied in fp32 and the
product scaled, which is the same arithmetic up to summation order.

Everything here runs on the device without reading values back to the host
and with shapes fixed by the input's, so CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.skinny_gemm import SkinnyLinear
from engine.quantization.scheme import Quantization

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# A floor on scales: an all-zero row gets a finite positive scale, not 0/0
# (vLLM's floor on dynamic per-token scales).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# cuBLASLt's FP8 GEMM needs both matrix dimensions of the weight in multiples of this.
GEMM_ALIGN = 16
MIN_FP8_CAPABILITY = (8, 9)


@dataclass(slots=True)
class QuantizedRows:
    """A matrix as FP8 values and one float32 scale per row: row i = data[i] * scale[i]."""

    data: torch.Tensor  # float8_e4m3fn, (rows, cols)
    scale: torch.Tensor  # float32, (rows,)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale.unsqueeze(-1)).to(dtype)


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Symmetric FP8 per row (an output channel of a weight, a token of an
    activation): each row's absolute maximum maps to the format's largest value."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    data = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedRows(data, scale)


def fp8_gemm_reference(
    x: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x @ weight.T`` dequantized: the FP8 values (exact in fp32) multiplied in
    fp32, then scaled by each token's and each output channel's scale."""
    acc = torch.mm(x.data.float(), weight.float().t())
    return (acc * x.scale.unsqueeze(1) * weight_scale.unsqueeze(0)).to(out_dtype)


def fp8_gemm(
    x: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x @ weight.T`` by cuBLASLt's FP8 GEMM (CUDA; ``weight`` (N, K) row-major,
    so its transpose is the column-major operand the GEMM needs). Row-wise
    scaling produces bf16; other model dtypes are cast from it."""
    out = torch._scaled_mm(
        x.data,
        weight.t(),
        scale_a=x.scale.unsqueeze(1),
        scale_b=weight_scale.unsqueeze(0),
        out_dtype=torch.bfloat16,
    )
    return out if out_dtype is torch.bfloat16 else out.to(out_dtype)


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with W in FP8 (``weight``, (out, in)) and its per-row
    scales (``weight_scale``, float32); the bias stays in the model dtype.

    The loader fills ``weight`` and ``weight_scale`` together
    (engine/models/loader.py): from a float checkpoint by ``quantize_rows``
    of this rank's part, from a pre-quantized one by its scales
    (engine/quantization/checkpoint.py). Per-row quantization of a part is the
    same as of the whole, so fused and sharded layers quantize exactly as
    their pieces would.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # No initial values: the loader writes every row of both (as SkinnyLinear).
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        # A buffer, not a parameter: the loader fills it with the weight.
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.gemm_aligned = in_features % GEMM_ALIGN == 0 and out_features % GEMM_ALIGN == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q = quantize_rows(x.reshape(-1, self.in_features))
        if x.is_cuda and self.gemm_aligned:
            y = fp8_gemm(q, self.weight, self.weight_scale, x.dtype)
        else:
            y = fp8_gemm_reference(q, self.weight, self.weight_scale, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def linear_class(quantization: Quantization | None) -> type[nn.Module]:
    """The class of every projection of a model under ``quantization``."""
    return SkinnyLinear if quantization is None else Fp8Linear


def check_fp8_capability(capability: tuple[int, int], device_name: str) -> None:
    """ValueError at start-up for a GPU without FP8 tensor cores."""
    if tuple(capability) < MIN_FP8_CAPABILITY:
        major, minor = capability
        raise ValueError(
            f"FP8 weights (quantization) need a CUDA GPU of compute capability >= "
            f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}; {device_name} has "
            f"compute capability {major}.{minor} (run unquantized, or on the CPU)"
        )


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 on a GPU that cannot run its GEMM (the CPU runs the reference):
    by capability, then by one small row-wise GEMM, since whether this torch
    build has one for the GPU depends on its CUDA version too."""
    if device.type != "cuda":
        return
    name = torch.cuda.get_device_name(device)
    check_fp8_capability(torch.cuda.get_device_capability(device), name)
    probe = quantize_rows(torch.ones(GEMM_ALIGN, GEMM_ALIGN, device=device))
    try:
        fp8_gemm(probe, probe.data, probe.scale, torch.bfloat16)
    except RuntimeError as e:
        raise ValueError(
            f"FP8 weights (quantization): this torch build has no row-wise scaled FP8 GEMM "
            f"for {name}: {e}"
        ) from e
