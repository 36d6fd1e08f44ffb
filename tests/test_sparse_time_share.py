"""The sparse time path's share: 0.5 unless another share is clearly better on the tuning split."""

from __future__ import annotations

import numpy as np
import pytest

from behrt_rope.training.sparse_time_fit import EQUAL_SHARE, clear_share


def _parts(path_signal: float, n: int = 1200, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Targets ``(n, 3)``, each sample's patient, and deep and path logits: the deep part knows each label as
    well as ever, the path adds ``path_signal`` times as much of the answer plus noise of its own."""
    rng = np.random.default_rng(seed)
    y = (rng.random((n, 3)) < 0.25).astype(np.int64)
    deep = 1.0 * (2 * y - 1) + rng.normal(size=y.shape) * 2.0
    path = path_signal * (2 * y - 1) + rng.normal(size=y.shape) * 2.0
    return y, np.arange(n) // 4, deep, path


def test_a_path_that_knows_more_gets_the_larger_share():
    y, patients, deep, path = _parts(path_signal=3.0)
    choice = clear_share(deep, path, y, patients)
    assert choice.chosen == 0.75
    difference, low, _ = choice.over_reference[0.75]
    assert low > 0 and difference == pytest.approx(choice.macro_ap[0.75] - choice.macro_ap[0.5], abs=1e-4)


def test_two_parts_of_equal_strength_keep_the_equal_mix():
    y, patients, deep, path = _parts(path_signal=1.0)
    choice = clear_share(deep, path, y, patients)
    assert choice.chosen == EQUAL_SHARE
    assert all(low <= 0 for _, low, _ in choice.over_reference.values())
