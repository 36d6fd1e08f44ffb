"""The ceiling's split by history: macro AP and gap closed on codes already on file and on new onsets."""

from __future__ import annotations

import numpy as np
import pytest

from behrt_rope.evaluation.ceiling import ORACLE, gap_by_history
from behrt_rope.evaluation.metrics import summary_metrics


@pytest.fixture(scope="module")
def cells():
    """600 samples x 6 codes; the 'model' knows the outcome exactly on codes on file and nothing on new ones."""
    rng = np.random.default_rng(0)
    y = rng.random((600, 6)) < 0.3
    history = rng.random((600, 6)) < 0.4
    noise = rng.random((600, 6))
    predictions = {
        "low": rng.random((600, 6)),
        ORACLE: 0.4 * y + 0.6 * noise,  # good everywhere, not perfect
        "model": np.where(history, y.astype(float), rng.random((600, 6))),
    }
    return y, history, predictions


def test_each_part_scores_only_its_cells(cells):
    y, history, predictions = cells
    parts = gap_by_history(y, predictions, history, "low", n_bootstrap=30, seed=1)
    for part, mask in (("on_file", history), ("new_onset", ~history)):
        expected = summary_metrics(y, predictions["model"], mask)["macro_ap"]
        assert parts[part]["model"]["macro_ap"] == pytest.approx(expected)
        low, high = parts[part]["model"]["ci"]
        assert low <= parts[part]["model"]["macro_ap"] <= high
        assert parts[part]["model"]["n_codes_macro"] == 6


def test_gap_closed_tells_where_a_predictor_earns_it(cells):
    y, history, predictions = cells
    parts = gap_by_history(y, predictions, history, "low", n_bootstrap=30, seed=1)
    assert parts["on_file"]["model"]["macro_ap"] == pytest.approx(1.0)  # exact on codes on file
    assert parts["on_file"]["model"]["gap_closed"]["point"] > 1.0  # beyond the (imperfect) oracle there
    assert abs(parts["new_onset"]["model"]["gap_closed"]["point"]) < 0.2  # a coin toss, like the low anchor
    for part in parts.values():
        assert part[ORACLE]["gap_closed"]["point"] == pytest.approx(1.0)
        assert part["low"]["gap_closed"]["point"] == pytest.approx(0.0)
