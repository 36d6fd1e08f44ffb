"""Rotary position embedding (RoPE) with explicit positions, and BEHRT's additive sinusoidal table.

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021) rotates every query
and key by an angle proportional to its position, so that the score ``q(m) . k(n)`` depends on the positions
only through ``m - n``. We use the paper's INTERLEAVED layout: the head dimension ``d`` is split into ``d/2``
adjacent pairs ``(x[2i], x[2i+1])`` (0-based ``i``), and pair ``i`` is rotated by the angle ``m * theta_i``
with ``theta_i = base^(-2i/d)`` (the paper's ``theta_i = 10000^(-2(i-1)/d)``, 1-based). This is the layout of
the paper's eq. 34 and of Hugging Face's RoFormer; it is NOT the "rotate_half" layout of GPT-NeoX / Llama,
which pairs ``x[i]`` with ``x[i + d/2]``.

Positions are data, not ``arange``: a token's position may be its visit number, its index, or its age, and two
tokens may share one (codes of one visit). So the angle tables have a batch dimension, ``(B, T, d/2)``.

Precision: the angles ``m * theta_i`` reach thousands of radians; in bf16 (8 significant bits) an angle near
2000 is off by up to 8 rad, so cos/sin are meaningless. Mixed-precision autocast would do exactly that to a
``positions @ theta`` matmul, so :func:`rope_angles` disables autocast and works in float64 (float32 on MPS,
which has no float64), then returns float32 tables; :func:`apply_rope` casts them to the activations' dtype
only when multiplying.
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The rotation frequency of each pair: ``theta_i = base^(-2i/head_dim)``, ``i = 0 .. head_dim/2 - 1``.

    Returns a ``(head_dim/2,)`` tensor in radians per unit of position.

    >>> rope_frequencies(4, base=100.0).tolist()
    [1.0, 0.1]
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (d/2,): 2i/d
    return (base**-exponents).to(dtype)


def _angle_dtype(device: torch.device) -> torch.dtype:
    """float64 for the angle arithmetic, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def rope_angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles ``positions * theta_i``, for :func:`apply_rope`.

    Args:
        positions: ``(B, T)`` positions, any real dtype; fractional values (ages) are allowed.
        head_dim: ``d``, the per-head size of queries and keys (even).
        base: RoPE frequency base.

    Returns:
        ``(cos, sin)``, each ``(B, T, d/2)`` float32: entry ``[b, t, i]`` belongs to pair ``(2i, 2i+1)``.

    The product is an elementwise broadcast (``torch.outer`` per row), never a matmul, and runs with autocast
    disabled in float64, so the tables are exact to float32 rounding at any position.

    >>> cos, sin = rope_angles(torch.tensor([[0.0, 1.0]]), head_dim=4, base=100.0)
    >>> cos.shape
    torch.Size([1, 2, 2])
    >>> [round(v, 4) for v in sin[0, 1].tolist()]  # sin(1 * 1), sin(1 * 0.1)
    [0.8415, 0.0998]
    """
    if positions.dim() != 2:
        raise ValueError(f"positions must be (B, T), got shape {tuple(positions.shape)}")
    dtype = _angle_dtype(positions.device)
    with torch.autocast(device_type=positions.device.type, enabled=False):
        theta = rope_frequencies(head_dim, base, dtype).to(positions.device)  # (d/2,)
        angles = positions.to(dtype)[..., None] * theta  # (B, T, d/2)
        return angles.cos().float(), angles.sin().float()


def per_head_angles(
    sources: list[tuple[torch.Tensor, int]], head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables where groups of heads take their positions from different sources.

    Args:
        sources: ``[(positions, n_heads), ...]``: heads are assigned in order, ``n_heads`` of them rotating by
            each ``(B, T)`` positions tensor (e.g. visit index for the first heads, age in days for the rest).
        head_dim, base: as :func:`rope_angles`.

    Returns:
        ``(cos, sin)``, each ``(B, n_heads_total, T, d/2)`` float32, for :func:`apply_rope`.

    >>> v, a = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 30.0]])
    >>> cos, sin = per_head_angles([(v, 1), (a, 2)], head_dim=2)
    >>> cos.shape, [round(x, 3) for x in cos[0, :, 1, 0].tolist()]
    (torch.Size([1, 3, 2, 1]), [0.54, 0.154, 0.154])
    """
    tables = [(*rope_angles(positions, head_dim, base), n) for positions, n in sources if n > 0]
    cos = torch.cat([c[:, None].expand(-1, n, -1, -1) for c, _, n in tables], dim=1)  # (B, nh, T, d/2)
    sin = torch.cat([s[:, None].expand(-1, n, -1, -1) for _, s, n in tables], dim=1)  # (B, nh, T, d/2)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each interleaved pair ``(x[2i], x[2i+1])`` of ``x`` by its angle.

    Args:
        x: ``(B, H, T, d)`` queries or keys.
        cos, sin: ``(B, T, d/2)`` tables from :func:`rope_angles`, shared by all heads, or ``(B, H, T, d/2)``
            tables from :func:`per_head_angles`, one per head.

    Returns:
        ``(B, H, T, d)`` in ``x``'s dtype. Per pair: ``(x0 cos - x1 sin, x1 cos + x0 sin)``, i.e. the paper's
        eq. 34 ``x * cos + rotate_pairs(x) * sin`` without materialising the repeated tables.
    """
    if cos.dim() == 3:  # shared by all heads: broadcast
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d/2)
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of ``x`` ``(..., d)`` by tables ``(..., d/2)`` that broadcast against it.

    Per pair: ``(x0 cos - x1 sin, x1 cos + x0 sin)``, i.e. the paper's eq. 34 ``x * cos + rotate_pairs(x) *
    sin`` without materialising the repeated tables. The tables are cast to ``x``'s dtype only here.

    In float32 and float64 the interleaved pair ``(x0, x1)`` is read as the complex number ``x0 + i x1`` and
    multiplied by ``cos + i sin``: one kernel over ``x``, no copies, the same four products and two sums per
    pair (equal to the real form to float rounding, about 8x faster on CPU). bf16 (no complex type) and MPS take
    the real form.

    >>> rotate(torch.tensor([1.0, 0.0]), torch.tensor([0.0]), torch.tensor([1.0])).tolist()  # a quarter turn
    [0.0, 1.0]
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if _complex_view_ok(x):
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (..., d/2): x0 + i x1
        return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)  # (..., d)
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x (..., d/2): even and odd members of each pair
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)  # (..., d)


def _complex_view_ok(x: torch.Tensor) -> bool:
    """Whether ``x``'s pairs can be viewed as complex numbers: float32/64 off MPS, pairs adjacent in memory
    (last stride 1, every other stride and the offset even; ``view_as_complex``'s conditions)."""
    if x.dtype not in (torch.float32, torch.float64) or x.device.type == "mps" or x.dim() == 0:
        return False
    strides = [s for s, n in zip(x.stride()[:-1], x.shape[:-1], strict=True) if n > 1]
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in strides)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: the paper's eq. 34 partner vector, shape kept.

    >>> rotate_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist()
    [-2.0, 1.0, -4.0, 3.0]
    """
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x (..., d/2)
    return torch.stack((-x1, x0), dim=-1).flatten(-2)  # (..., d)


def sinusoidal_table(max_positions: int, dim: int) -> torch.Tensor:
    """The fixed additive position embedding of BEHRT (after Vaswani et al. 2017), ``(max_positions, dim)``.

    ``table[p, 2i] = sin(p / 10000^(2i/dim))`` and ``table[p, 2i+1] = cos(p / 10000^(2i/dim))``: sin and cos
    of one frequency interleave, as in the Transformer paper. (BEHRT's released code used the column index
    instead of the pair index in the exponent, which gives its odd columns slightly different frequencies; we
    follow the paper.) Used only by the ``position_encoding="absolute"`` ablation. Built in float64, returned
    as float32.

    >>> t = sinusoidal_table(3, 4)
    >>> t.shape
    torch.Size([3, 4])
    >>> t[0].tolist()
    [0.0, 1.0, 0.0, 1.0]
    """
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    position = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    pair = torch.arange(0, dim, 2, dtype=torch.float64)  # (dim/2,): 2i
    inv_freq = torch.exp(pair * (-math.log(10000.0) / dim))  # (dim/2,): 10000^(-2i/dim)
    angles = position * inv_freq  # (P, dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).float()  # (P, dim)
