"""BEHRT's MLM masking: the published 15% / 80-10-10 scheme, on real codes only."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from behrt_rope.data.masking import IGNORE_INDEX, mask_tokens
from behrt_rope.schema import CLS_ID, MASK_ID, N_SPECIAL, PAD_ID, SEP_ID, UNK_ID

SPECIAL_IDS = (PAD_ID, CLS_ID, SEP_ID, MASK_ID, UNK_ID)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_proportions_on_a_large_sample() -> None:
    vocab_size, n = 1000, 200_000
    tokens = torch.randint(N_SPECIAL, vocab_size, (200, n // 200), generator=gen(123))
    inputs, labels = mask_tokens(tokens, vocab_size, gen(0))
    chosen = labels != IGNORE_INDEX
    masked = inputs == MASK_ID
    replaced = chosen & ~masked & (inputs != tokens)
    unchanged = chosen & (inputs == tokens)
    # A random replacement equals the original with probability 1 / (number of real codes).
    same = 1.0 / (vocab_size - N_SPECIAL)
    expected = {
        "chosen": (chosen, 0.15),
        "masked": (masked, 0.15 * 0.8),
        "replaced": (replaced, 0.15 * 0.1 * (1 - same)),
        "unchanged": (unchanged, 0.15 * 0.1 + 0.15 * 0.1 * same),
    }
    for name, (flags, p) in expected.items():
        rate = flags.float().mean().item()
        sigma = math.sqrt(p * (1 - p) / n)  # binomial standard error of the rate
        assert abs(rate - p) < 5 * sigma, f"{name}: rate {rate:.5f}, expected {p:.5f} +- {5 * sigma:.5f}"
    assert abs(chosen.float().mean().item() - 0.15) < 0.005
    # masked, replaced and unchanged partition the chosen tokens; nothing else changes
    assert torch.equal(masked | replaced | unchanged, chosen)
    assert torch.equal(inputs[~chosen], tokens[~chosen])


def test_conditional_split_of_the_chosen_tokens() -> None:
    tokens = torch.randint(N_SPECIAL, 5000, (100, 1000), generator=gen(1))
    inputs, labels = mask_tokens(tokens, 5000, gen(2))
    chosen = labels != IGNORE_INDEX
    n = int(chosen.sum())
    masked = (inputs[chosen] == MASK_ID).float().mean().item()
    kept = (inputs[chosen] == tokens[chosen]).float().mean().item()
    for rate, p in ((masked, 0.8), (kept, 0.1)):
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)


sequences = st.lists(
    st.lists(st.one_of(st.sampled_from(SPECIAL_IDS), st.integers(N_SPECIAL, 29)), min_size=1, max_size=30),
    min_size=1,
    max_size=4,
).map(lambda rows: [row + [PAD_ID] * (30 - len(row)) for row in rows])


@settings(max_examples=60, deadline=None)
@given(
    rows=sequences,
    seed=st.integers(0, 2**31 - 1),
    mask_prob=st.sampled_from([0.15, 0.5, 1.0]),
)
def test_special_tokens_are_never_chosen_and_labels_align(rows: list[list[int]], seed: int, mask_prob: float) -> None:
    tokens = torch.tensor(rows)
    original = tokens.clone()
    inputs, labels = mask_tokens(tokens, 30, gen(seed), mask_prob=mask_prob)
    assert torch.equal(tokens, original)  # not mutated
    special = tokens < N_SPECIAL
    chosen = labels != IGNORE_INDEX
    assert not (chosen & special).any()
    assert torch.equal(inputs[special], tokens[special])
    # labels are the original ids exactly where a token is chosen; everything changed is chosen
    assert torch.equal(labels[chosen], tokens[chosen])
    assert not ((inputs != tokens) & ~chosen).any()
    # a chosen token is [MASK] or a real code, never another special token
    corrupted = inputs[chosen]
    assert ((corrupted == MASK_ID) | ((corrupted >= N_SPECIAL) & (corrupted < 30))).all()
    if mask_prob == 1.0:
        assert torch.equal(chosen, ~special)


def test_random_replacements_are_real_codes() -> None:
    tokens = torch.randint(N_SPECIAL, 12, (50, 200), generator=gen(3))
    inputs, labels = mask_tokens(tokens, 12, gen(4), mask_prob=1.0, mask_token_frac=0.0, random_token_frac=1.0)
    assert not (inputs == MASK_ID).any()
    assert ((inputs >= N_SPECIAL) & (inputs < 12)).all()
    # uniform over the 7 real codes
    counts = torch.bincount(inputs.flatten(), minlength=12)[N_SPECIAL:].float()
    assert counts.min() > 0.9 * counts.mean()
    assert torch.equal(labels, tokens)


def test_all_mask_and_no_mask_extremes() -> None:
    tokens = torch.tensor([[CLS_ID, 7, 8, SEP_ID, 9, SEP_ID, PAD_ID]])
    inputs, labels = mask_tokens(tokens, 10, gen(), mask_prob=1.0, mask_token_frac=1.0, random_token_frac=0.0)
    assert inputs.tolist() == [[CLS_ID, MASK_ID, MASK_ID, SEP_ID, MASK_ID, SEP_ID, PAD_ID]]
    assert labels.tolist() == [[-100, 7, 8, -100, 9, -100, -100]]
    inputs, labels = mask_tokens(tokens, 10, gen(), mask_prob=0.0)
    assert torch.equal(inputs, tokens)
    assert (labels == IGNORE_INDEX).all()


def test_seeded_determinism() -> None:
    tokens = torch.randint(N_SPECIAL, 100, (8, 64), generator=gen(5))
    first = mask_tokens(tokens, 100, gen(42))
    second = mask_tokens(tokens, 100, gen(42))
    other = mask_tokens(tokens, 100, gen(43))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[1], other[1])


def test_dtypes_and_no_mutation() -> None:
    tokens = torch.randint(N_SPECIAL, 100, (4, 16), generator=gen(6), dtype=torch.int32)
    original = tokens.clone()
    inputs, labels = mask_tokens(tokens, 100, gen(7), mask_prob=0.5)
    assert torch.equal(tokens, original)
    assert inputs.dtype == torch.int32
    assert labels.dtype == torch.long
    assert inputs.data_ptr() != tokens.data_ptr()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": N_SPECIAL},
        {"mask_prob": 1.5},
        {"mask_token_frac": 0.8, "random_token_frac": 0.3},
        {"random_token_frac": -0.1},
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, float]) -> None:
    args: dict[str, float] = {"vocab_size": 20, **kwargs}
    with pytest.raises(ValueError):
        mask_tokens(torch.tensor([[1, 6]]), generator=gen(), **args)  # type: ignore[arg-type]
