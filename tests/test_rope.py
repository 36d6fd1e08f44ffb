"""Rotary position embedding: against the RoFormer paper's formulas, its properties, precision, Hugging Face."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import rope_tables
from behrt_rope.model.rope import (
    apply_rope,
    rope_angles,
    rope_frequencies,
    rotate_pairs,
    sinusoidal_table,
)

FAST = settings(max_examples=40, deadline=None)


def dense_rotation(m: float, d: int, base: float = 10000.0) -> torch.Tensor:
    """The paper's R(Theta, m) (eq. 15): block-diagonal 2x2 rotations by m * theta_i, float64 ``(d, d)``."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        angle = m * base ** (-2 * i / d)  # the paper's theta_{i+1} = base^(-2((i+1)-1)/d)
        c, s = math.cos(angle), math.sin(angle)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = c, -s
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = s, c
    return r


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Our RoPE on ``x`` ``(B, H, T, d)`` at ``positions`` ``(B, T)``."""
    cos, sin = rope_angles(positions, x.shape[-1], base)
    return apply_rope(x, cos, sin)


def test_frequencies_follow_the_paper() -> None:
    d = 8
    expected = [10000.0 ** (-2 * (i - 1) / d) for i in range(1, d // 2 + 1)]  # 1-based, as in the paper
    assert rope_frequencies(d).tolist() == pytest.approx(expected, rel=1e-15)
    with pytest.raises(ValueError):
        rope_frequencies(7)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_equals_the_papers_dense_rotation_matrix(d: int) -> None:
    ms = [0.0, 1.0, 2.0, 7.0, 31.0, 123.0, 999.0, 2.5]  # fractional positions (ages) too
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, len(ms), d, generator=gen, dtype=torch.float64)  # (B, H, T, d)
    got = rope(x, torch.tensor([ms]))
    for t, m in enumerate(ms):
        expected = x[0, :, t] @ dense_rotation(m, d).T  # (H, d): R x for every head
        torch.testing.assert_close(got[0, :, t], expected, atol=1e-6, rtol=0)


def test_equals_the_papers_sparse_form() -> None:
    """Eq. 34: R x = x * (cos m theta_1, cos m theta_1, ...) + (-x2, x1, -x4, x3, ...) * (sin m theta_1, ...)."""
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([[0.0, 3.0, 3.0, 40.0, 511.0], [1.0, 2.0, 5.0, 8.0, 1500.0]])  # (B, T)
    x = torch.randn(2, 4, 5, 16, generator=gen)  # (B, H, T, d)
    cos, sin = rope_angles(positions, 16)  # (B, T, d/2)
    cos_full = cos.repeat_interleave(2, dim=-1)[:, None]  # (B, 1, T, d): cos m theta_1 twice, then theta_2 ...
    sin_full = sin.repeat_interleave(2, dim=-1)[:, None]  # (B, 1, T, d)
    expected = x * cos_full + rotate_pairs(x) * sin_full
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)


def test_golden_values() -> None:
    # d = 4, base 100: theta = (1, 0.1); position 1 rotates (1, 2) by 1 rad and (3, 4) by 0.1 rad:
    # (cos 1 - 2 sin 1, sin 1 + 2 cos 1, 3 cos .1 - 4 sin .1, 3 sin .1 + 4 cos .1).
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 1, 4)
    got = rope(x, torch.tensor([[1.0]]), base=100.0).flatten().tolist()
    assert got == pytest.approx([-1.1426396, 1.9220755, 2.5856789, 4.2795170], abs=1e-6)
    # d = 8, base 10000, position 3 (pinned from this implementation, checked against the dense matrix above).
    x = torch.arange(1.0, 9.0, dtype=torch.float64).view(1, 1, 1, 8)
    got = rope(x, torch.tensor([[3.0]])).flatten().tolist()
    expected = [-1.2722325, -1.8388650, 1.6839287, 4.7079067, 4.8177772, 6.1472778, 6.9759687, 8.0209642]
    assert got == pytest.approx(expected, abs=1e-6)
    # Position 0 is the identity.
    assert rope(x, torch.tensor([[0.0]])).flatten().tolist() == x.flatten().tolist()


def random_x(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    positions=st.lists(st.floats(0.0, 5000.0, allow_nan=False), min_size=1, max_size=6),
    half_d=st.integers(1, 8),
)
def test_rotation_preserves_norms(seed: int, positions: list[float], half_d: int) -> None:
    x = random_x(seed, (1, 2, len(positions), 2 * half_d))
    y = rope(x, torch.tensor([positions]))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-9)
    # Each pair on its own keeps its length, too: it is a rotation per pair.
    torch.testing.assert_close(
        y.unflatten(-1, (-1, 2)).norm(dim=-1), x.unflatten(-1, (-1, 2)).norm(dim=-1), rtol=1e-6, atol=1e-9
    )


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    m=st.integers(0, 1000),
    n=st.integers(0, 1000),
    shift=st.integers(0, 1000),
    half_d=st.integers(1, 8),
)
def test_score_depends_only_on_relative_position(seed: int, m: int, n: int, shift: int, half_d: int) -> None:
    d = 2 * half_d
    q, k = random_x(seed, (2, 1, 1, 1, d)).unbind(0)  # 2 x (B, H, T, d) with B = H = T = 1

    def score(pm: float, pn: float) -> float:
        return float((rope(q, torch.tensor([[pm]])) * rope(k, torch.tensor([[pn]]))).sum())

    scale = float(q.norm() * k.norm())
    assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-5 * scale)
    # and it equals <q, R_{n-m} k>, the paper's eq. 16
    rel = float(q.flatten() @ dense_rotation(n - m, d) @ k.flatten())
    assert score(m, n) == pytest.approx(rel, abs=1e-5 * scale)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    m=st.floats(0.0, 120.0),
    n=st.floats(0.0, 120.0),
    shift=st.floats(0.0, 120.0),
)
def test_relative_property_holds_for_fractional_positions(seed: int, m: float, n: float, shift: float) -> None:
    """Ages (times rope_age_scale) are fractional positions; the property holds for them as well."""
    q, k = random_x(seed, (2, 1, 1, 1, 8)).unbind(0)

    def score(pm: float, pn: float) -> float:
        return float((rope(q, torch.tensor([[pm]])) * rope(k, torch.tensor([[pn]]))).sum())

    assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-5 * float(q.norm() * k.norm()))


def test_tables_are_float32_and_shared_by_heads() -> None:
    positions = torch.tensor([[0, 1, 2], [5, 5, 6]])  # integer positions are fine too
    cos, sin = rope_angles(positions, 8)
    assert cos.shape == sin.shape == (2, 3, 4)
    assert cos.dtype == sin.dtype == torch.float32
    with pytest.raises(ValueError):
        rope_angles(torch.zeros(3), 8)  # positions must be (B, T)


def test_tables_stay_exact_under_bf16_autocast() -> None:
    d = 64
    positions = torch.arange(0.0, 2001.0).view(1, -1)  # (1, T)
    reference = positions.double()[0, :, None] * rope_frequencies(d)  # (T, d/2) float64 angles
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rope_angles(positions, d)
        # What not to do, for the record: a matmul under autocast runs in bf16, whose 8 significant bits put
        # an angle near 2000 off by up to 8 rad, so cos is off by up to 2 -- meaningless.
        naive = (positions[0, :, None] @ rope_frequencies(d, dtype=torch.float32)[None, :]).cos()
    assert naive.dtype == torch.bfloat16
    assert (naive.double() - reference.cos()).abs().max() > 0.5
    assert cos.dtype == torch.float32
    assert (cos[0].double() - reference.cos()).abs().max() < 1e-6
    assert (sin[0].double() - reference.sin()).abs().max() < 1e-6


def test_apply_casts_tables_to_the_activation_dtype() -> None:
    positions = torch.arange(0.0, 300.0).view(1, -1)
    cos, sin = rope_angles(positions, 8)
    x = random_x(0, (1, 2, 300, 8))
    y16 = apply_rope(x.bfloat16(), cos, sin)
    assert y16.dtype == torch.bfloat16
    # Only bf16 rounding of the activations and of the (exact) tables: relative error ~1e-2, not O(1).
    torch.testing.assert_close(y16.double(), apply_rope(x, cos, sin), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_form_equals_the_real_form(dtype: torch.dtype) -> None:
    """float32/64 rotate pairs as complex numbers; a layout view_as_complex cannot take (odd strides) and
    the explicit eq. 34 form give the same values to rounding, with tables shared by heads and one per head."""
    positions = torch.tensor([[0.0, 1.0, 1.0, 7.0, 250.5], [3.0, 3.0, 9.0, 40.0, 1999.0]])
    cos, sin = rope_angles(positions, 8)
    x = random_x(2, (2, 3, 5, 8)).to(dtype)
    odd = torch.cat([x, x[..., :1]], dim=-1)[..., :8]  # same values, last-but-one stride 9: the real path
    assert odd.stride(-2) % 2 == 1
    expected = x * cos.repeat_interleave(2, -1)[:, None].to(dtype) + rotate_pairs(x) * sin.repeat_interleave(2, -1)[
        :, None
    ].to(dtype)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)
    torch.testing.assert_close(apply_rope(odd, cos, sin), apply_rope(x, cos, sin))  # to rounding (1 ulp)
    per_head = cos[:, None].expand(-1, 3, -1, -1), sin[:, None].expand(-1, 3, -1, -1)  # (B, H, T, d/2)
    torch.testing.assert_close(apply_rope(x, *per_head), apply_rope(x, cos, sin))


def test_sinusoidal_table_matches_the_transformer_formula() -> None:
    table = sinusoidal_table(50, 6)
    assert table.shape == (50, 6)
    assert table.dtype == torch.float32
    for p in (0, 1, 17, 49):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)
    with pytest.raises(ValueError):
        sinusoidal_table(10, 5)


def test_matches_hugging_face_roformer_rotation() -> None:
    """Hugging Face's RoFormer also pairs (2i, 2i+1). Its encoder always uses positions arange(T) (it takes no
    position ids), so we compare the rotation function itself, against ours with token positions."""
    pytest.importorskip("transformers")
    from transformers.models.roformer.modeling_roformer import (
        RoFormerSelfAttention,
        RoFormerSinusoidalPositionalEmbedding,
    )

    B, H, T, d = 2, 3, 64, 16
    q, k = random_x(7, (2, B, H, T, d)).float().unbind(0)
    table = RoFormerSinusoidalPositionalEmbedding(T, d).create_weight()  # (T, d): sin half, then cos half
    hf_q, hf_k = RoFormerSelfAttention.apply_rotary_position_embeddings(table[None, None], q, k)
    positions = torch.arange(T, dtype=torch.float32).expand(B, T)  # (B, T)
    torch.testing.assert_close(rope(q, positions), hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope(k, positions), hf_k, atol=1e-5, rtol=1e-5)


def test_mixed_heads_each_rotate_by_their_own_source() -> None:
    """With ``model.age_heads``, a visit head's score between two tokens depends only on the visits between
    them and an age head's only on the days between them: shifting either source leaves every score alone,
    and widening one gap moves only the heads that rotate by it."""
    config = ModelConfig(vocab_size=20, hidden_size=32, num_heads=4, age_heads=2)
    q, k = random_x(7, (2, 1, 4, 2, 8)).unbind(0)  # (B, heads, T, d), 2 visit heads then 2 age heads

    def scores(visits: list[float], ages: list[float]) -> torch.Tensor:
        positions, age = torch.tensor([visits]), torch.tensor([ages], dtype=torch.float64)
        cos, sin = rope_tables(config, positions, age, num_heads=4, age_heads=2)
        return (apply_rope(q, cos, sin)[0, :, 1] * apply_rope(k, cos, sin)[0, :, 0]).sum(-1)  # (heads,)

    base = scores([0.0, 3.0], [50.0, 52.5])
    assert torch.allclose(scores([5.0, 8.0], [50.0, 52.5]), base, atol=1e-4)  # visits shifted
    assert torch.allclose(scores([0.0, 3.0], [61.0, 63.5]), base, atol=1e-4)  # ages shifted by 11 years
    wider_visits = scores([0.0, 4.0], [50.0, 52.5])
    assert torch.allclose(wider_visits[2:], base[2:], atol=1e-4)
    assert (wider_visits[:2] - base[:2]).abs().min() > 1e-3
    wider_days = scores([0.0, 3.0], [50.0, 52.6])
    assert torch.allclose(wider_days[:2], base[:2], atol=1e-4)
    assert (wider_days[2:] - base[2:]).abs().min() > 1e-3
