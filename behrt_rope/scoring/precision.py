"""Which floating-point type scoring runs in: bf16 where the hardware computes it natively, else fp32."""

from __future__ import annotations

from typing import Literal

import torch

Precision = Literal["auto", "fp32", "bf16"]


def native_bf16(device: torch.device) -> bool:
    """True when ``device`` has bf16 matrix units (CUDA with bf16; a CPU with AVX-512 BF16 or AMX).

    On other CPUs oneDNN emulates bf16 through fp32, which is slower than fp32 itself.
    """
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """``auto``: bf16 if :func:`native_bf16`, else fp32; ``fp32`` and ``bf16`` are taken as asked."""
    if precision == "bf16" or (precision == "auto" and native_bf16(device)):
        return torch.bfloat16
    return torch.float32
