"""``benchmarks/share_choice.py``: per-label shares go where each label's better part is; the study scores them
on patients that did not choose them."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.share_choice import loss_by_label, method_shares, study


def _two_labels(n: int = 600, seed: int = 0) -> dict[str, np.ndarray]:
    """Label 0: the deep logit knows the answer, the path's is noise; label 1: the other way round."""
    rng = np.random.default_rng(seed)
    y = (rng.random((n, 2)) < 0.3).astype(np.int64)
    signal, noise = 3.0 * (2 * y - 1) + rng.normal(size=(n, 2)), 3.0 * rng.normal(size=(n, 2))
    deep = np.stack([signal[:, 0], noise[:, 1]], axis=1)
    path = np.stack([noise[:, 0], signal[:, 1]], axis=1)
    on_file = rng.random((n, 2)) < 0.5
    return {
        "y": y,
        "patients": np.arange(n) // 3,
        "on_file": on_file,
        "deep": deep,
        "path": path,
        "state_share": np.array(0.0),
    }


def _shares(data: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    return method_shares(data["y"], data["deep"], data["path"], data["patients"], data["on_file"])


def test_a_share_per_label_follows_the_part_that_knows_the_label():
    data = _two_labels()
    shares, common = _shares(data)
    assert all(share.shape == (2, 2) for share in shares.values())
    own = shares["per_label"][0]
    assert own[0] <= 0.25 and own[1] >= 0.75
    assert 0.25 <= common <= 0.75  # one share for both labels cannot follow either
    for k in (5, 20, 50):  # shrunk towards the common share, but with 180 positives most of the way
        shrunk = shares[f"per_label_shrunk_{k}"][1]
        assert np.all(np.abs(shrunk - common) <= np.abs(own - common) + 1e-12)
        assert shrunk[0] < common < shrunk[1]


def test_shares_chosen_by_tuning_loss_follow_the_better_part():
    data = _two_labels()
    shares, _ = _shares(data)
    by_loss = shares["per_label_by_loss"][0]
    assert by_loss[0] <= 0.2 and by_loss[1] >= 0.8
    assert 0.2 <= shares["common_by_loss"][0, 0] <= 0.8  # one share for both: neither end
    deep_only = {**data, "path": 3.0 * np.random.default_rng(5).normal(size=data["y"].shape)}
    shares, _ = _shares(deep_only)
    assert shares["common_by_loss"][0, 0] <= 0.25  # a path of pure noise gets little of the logit


def test_the_study_scores_each_method_on_patients_that_did_not_choose_it():
    result = study(_two_labels(), choose_patients=60, repeats=4, seed=1)
    assert sum(result["by_history_chosen"]["by_history_clear"].values()) == 4
    methods = result["methods"]
    assert methods["best_point_estimate"]["minus_best_point_estimate"] == 0.0
    assert methods["per_label"]["minus_best_point_estimate"] > 0.05 and methods["per_label"]["wins"] == 1.0
    assert methods["per_label"]["macro_ap"] > max(methods["deep_alone"]["macro_ap"], methods["path_alone"]["macro_ap"])
    assert sum(result["best_point_estimate_chosen"].values()) == 4
    assert result["tuning_patients"] == 200 and result["labels"] == 2


def test_loss_by_label_is_the_mean_cross_entropy_of_each_label():
    y = np.array([[1, 0], [0, 0]])
    logits = np.array([[2.0, -1.0], [0.0, 800.0]])  # a huge wrong logit stays finite
    expected_0 = (np.log1p(np.exp(-2.0)) + np.log(2.0)) / 2
    np.testing.assert_allclose(loss_by_label(y, logits), [expected_0, (np.log1p(np.exp(-1.0)) + 800.0) / 2])


def test_the_study_needs_patients_left_to_score():
    with pytest.raises(SystemExit, match="leaves no tuning patients"):
        study(_two_labels(n=30), choose_patients=10, repeats=1, seed=0)


def _by_history(n: int = 900, seed: int = 2) -> dict[str, np.ndarray]:
    """Where the label's code is on file the deep logit knows the answer, where it is not the path's does."""
    rng = np.random.default_rng(seed)
    y = (rng.random((n, 2)) < 0.3).astype(np.int64)
    on_file = rng.random((n, 2)) < 0.5
    signal, noise = 3.0 * (2 * y - 1) + rng.normal(size=(n, 2)), 3.0 * rng.normal(size=(n, 2))
    deep, path = np.where(on_file, signal, noise), np.where(on_file, noise, signal)
    return {"y": y, "patients": np.arange(n) // 3, "on_file": on_file, "deep": deep, "path": path}


def test_shares_by_history_follow_the_part_that_knows_each_history():
    shares, _ = _shares(_by_history())
    for name in ("by_history", "by_history_clear"):
        on_file, new_onset = shares[name][:, 0]
        assert on_file <= 0.25 and new_onset >= 0.75, name
        assert np.all(shares[name][:, 0] == shares[name][:, 1])  # one pair for every label


def test_shares_by_history_stay_common_without_a_clear_gain():
    data = _two_labels()  # on file at random: the history tells nothing about which part knows a label
    shares, _ = _shares(data)
    default = shares["clearly_better_than_0.5"][0, 0]
    np.testing.assert_array_equal(shares["by_history_clear"], np.full((2, 2), default))


def test_the_rule_from_0_leaves_out_a_path_that_only_adds_noise():
    data = _two_labels()
    noise = 3.0 * np.random.default_rng(7).normal(size=data["y"].shape)
    deep_knows_both = {**data, "deep": np.where(data["y"] == 1, 3.0, -3.0) + data["deep"] * 0.3, "path": noise}
    shares, _ = _shares(deep_knows_both)
    assert shares["clearly_better_than_0.5_from_0"][0, 0] in (0.0, 0.1)
    assert shares["clearly_better_than_0.5"][0, 0] == 0.25  # the default grid's lowest share
    result = study(deep_knows_both, choose_patients=60, repeats=3, seed=1)
    assert sum(result["clear_rules_chosen"]["clearly_better_than_0.5_from_0"].values()) == 3
    methods = result["methods"]
    assert methods["clearly_better_than_0.5_from_0"]["macro_ap"] > methods["clearly_better_than_0.5"]["macro_ap"]
