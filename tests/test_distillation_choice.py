"""``finetune`` with ``sparse_time_distillation`` null: a second training only where the path leads the first
deep part and the budget has room, then the better deep part kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets
from behrt_rope.data.sequences import load_tokens
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.clear_gain import CHOICE_LEVEL
from behrt_rope.training.distillation_choice import (
    DISTILLATION_GRID,
    MIN_CHAIN_SECONDS,
    PREFERRED_WEIGHT,
    ROOM_MARGIN,
    PathLead,
    chains_seconds,
    choose_weight,
    path_leads,
    preferred_weight,
    room_for_another,
)
from behrt_rope.training.inference import multilabel_model, score_parts
from behrt_rope.training.state_path_fit import fit_state_path
from behrt_rope.training.tasks import macro_average_precision
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, error_line, read_metrics


@pytest.fixture(scope="module")
def etl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_etl(tmp_path_factory.mktemp("distil"), patients=160, seed=3)


def _finetune(etl: Path, out: Path, *overrides: str) -> int:
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "1", "task.min_label_count=2"]
    return main([*argv, *TINY_MODEL, *FAST_TRAINER, *overrides])


def _saved_parts_tuning_ap(etl: Path, out: Path) -> tuple[float, float]:
    """Macro AP of the saved model's deep part and of its path on the tuning split, scored afresh from the files."""
    bundle = load_bundle(out, "multilabel")
    seqs = load_tokens(etl).split(S.TUNING)
    samples = build_samples(seqs, TaskConfig(min_label_count=2))
    y = targets(seqs, samples, label_index(bundle["label_token_ids"], len(bundle["vocab"])))
    parts = score_parts(multilabel_model(bundle), seqs, samples.rows, samples.cuts, parts=("deep", "path"))
    return round(macro_average_precision(y, parts["deep"]), 5), round(macro_average_precision(y, parts["path"]), 5)


def _teacher_case(deep_noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Targets ``(N, L)`` of one truth, the deep part's and the teacher's probabilities (the teacher's logit noise 1,
    the deep part's ``deep_noise``) and the patients (four samples each)."""
    rng = np.random.default_rng(3)
    truth = rng.normal(-2.0, 1.5, (2400, 6))
    y = (rng.random(truth.shape) < 1 / (1 + np.exp(-truth))).astype(np.float32)
    deep, path = (1 / (1 + np.exp(-(truth + rng.normal(0, sd, truth.shape)))) for sd in (deep_noise, 1.0))
    return y, deep, path, np.repeat(np.arange(600), 4)


def test_a_second_training_is_skipped_only_where_the_deep_part_clearly_leads_its_teacher() -> None:
    y, deep, path, patients = _teacher_case(1.0)  # as good as the teacher: a close call either way
    close = path_leads(y, deep, path, patients)
    assert close.deep_minus_path is not None
    difference, low, high = close.deep_minus_path
    assert low < 0 < high and difference == pytest.approx(close.deep_macro_ap - close.path_macro_ap, abs=2e-5)
    assert not close.path_leads  # the deep part ahead by the point estimates, which decided until session 57
    assert not close.deep_clearly_leads  # close: the distilled training is tried, and the tuning split chooses
    y, deep, path, patients = _teacher_case(0.3)  # far better
    clear = path_leads(y, deep, path, patients)
    assert clear.deep_minus_path is not None and clear.deep_minus_path[1] > 0 and clear.deep_clearly_leads
    assert clear.report()["deep_minus_path"]["level"] == CHOICE_LEVEL


def _gate(monkeypatch: pytest.MonkeyPatch, forced: PathLead) -> list[PathLead]:
    """Make ``finetune``'s path-lead check return ``forced``; the list receives what the real check found."""
    seen: list[PathLead] = []

    def spy(y: np.ndarray, deep: np.ndarray, path: np.ndarray, patients: np.ndarray) -> PathLead:
        seen.append(path_leads(y, deep, path, patients))
        return forced

    monkeypatch.setattr("pipelines.finetune.path_leads", spy)
    return seen


def test_where_the_deep_part_does_not_clearly_lead_both_weights_train_and_the_saved_model_is_the_better(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close call (the deep part ahead of its teacher by the point estimates, its interval across 0, as on a
    recurrence_sparse draw where the distilled deep part then scored 0.016 better held out) trains both; labels
    alone, the leader's weight, stand unless the distilled deep part is clearly better."""
    close_call = PathLead(0.3007, 0.2999, (0.0008, -0.0017, 0.0031))
    seen = _gate(monkeypatch, close_call)
    out = tmp_path / "ft"
    assert _finetune(etl, out) == 0
    metrics = read_metrics(out)
    choice = metrics["distillation_choice"]
    assert choice["first_training_against_path"] == {
        "deep_macro_ap": 0.3007,
        "path_macro_ap": 0.2999,
        "path_leads": False,
        "deep_minus_path": {"difference": 0.0008, "low": -0.0017, "high": 0.0031, "level": CHOICE_LEVEL},
        "deep_clearly_leads": False,
    }
    scores = choice["tuning_deep_macro_ap"]
    assert choice["weights_tried"] == list(DISTILLATION_GRID) and choice["weights_not_tried"] == []
    assert set(scores) == {"0", "0.8"} and scores["0"] != scores["0.8"]  # two different trainings
    over = choice["tuning_deep_macro_ap_minus_preferred"]["0.8"]
    assert choice["preferred_weight"] == 0.0  # the deep part led the first comparison
    assert over["low"] <= over["difference"] <= over["high"]
    assert over["difference"] == pytest.approx(scores["0.8"] - scores["0"], abs=2e-5)
    chosen = 0.8 if over["low"] > 0 else 0.0  # the distilled deep part only when clearly better
    assert metrics["sparse_time_distillation"] == chosen
    saved_deep, saved_path = _saved_parts_tuning_ap(etl, out)
    assert saved_deep == pytest.approx(scores[f"{chosen:g}"], abs=2e-5)
    # the real check compared the first training's deep part with the path (frozen, the same in both runs)
    (real,) = seen
    assert real.deep_macro_ap == pytest.approx(scores["0"], abs=2e-5)
    assert real.path_macro_ap == pytest.approx(saved_path, abs=2e-5)
    assert real.deep_minus_path is not None  # with its paired interval over the tuning patients
    difference, low, high = real.deep_minus_path
    assert low <= difference <= high and difference == pytest.approx(scores["0"] - saved_path, abs=2e-5)
    second = out / "distillation_0.8" / S.CHECKPOINT_DIR / S.BEST_CHECKPOINT
    assert second.exists()
    assert choice["runs"]["0.8"]["best_checkpoint"] == str(second)
    assert metrics["best_checkpoint"] == choice["runs"][f"{chosen:g}"]["best_checkpoint"]


def test_where_the_first_deep_part_leads_the_path_it_stands_without_a_second_training(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gate(monkeypatch, PathLead(0.3, 0.2, (0.1, 0.05, 0.15)))  # clearly ahead: the interval above 0
    budget_asked: list[float | None] = []
    monkeypatch.setattr("pipelines.finetune.room_for_another", lambda left, first: budget_asked.append(left) or True)
    out = tmp_path / "ft"
    assert _finetune(etl, out) == 0
    metrics = read_metrics(out)
    choice = metrics["distillation_choice"]
    assert metrics["sparse_time_distillation"] == 0.0
    assert choice["weights_tried"] == [0.0] and choice["weights_not_tried"] == [0.8]
    lead = choice["first_training_against_path"]
    assert lead["deep_clearly_leads"] and lead["deep_minus_path"]["low"] == 0.05
    assert not (out / "distillation_0.8").exists()
    (left,) = budget_asked  # the budget is asked first: without room, no teacher is chosen
    assert left is not None and 0 < left <= 12 * 60


def test_without_room_in_the_time_budget_the_first_run_stands(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple] = []

    def no_room(left: float | None, first_seconds: float) -> bool:
        seen.append((left, first_seconds))
        return False

    monkeypatch.setattr("pipelines.finetune.room_for_another", no_room)
    lead_checks = _gate(monkeypatch, PathLead(0.1, 0.2))
    out = tmp_path / "ft"
    assert _finetune(etl, out) == 0
    metrics = read_metrics(out)
    choice = metrics["distillation_choice"]
    assert metrics["sparse_time_distillation"] == 0.0
    assert choice["weights_tried"] == [0.0] and choice["weights_not_tried"] == [0.8]
    assert not (out / "distillation_0.8").exists()
    # no teacher chosen and no lead check: both score the tuning split, time the budget no longer has
    assert lead_checks == [] and choice["first_training_against_path"] is None
    assert choice["tuning_deep_macro_ap"]["0"] == pytest.approx(_saved_parts_tuning_ap(etl, out)[0], abs=2e-5)
    ((left, first_seconds),) = seen
    assert 0 < left <= 12 * 60 and first_seconds == metrics["train_seconds"]  # the default 12-minute budget


def test_a_weight_that_is_set_trains_once_and_one_outside_the_unit_interval_is_refused(
    etl: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ft"
    assert _finetune(etl, out, "sparse_time_distillation=0") == 0
    metrics = read_metrics(out)
    assert metrics["sparse_time_distillation"] == 0.0 and "distillation_choice" not in metrics
    assert not (out / "distillation_0.8").exists()
    capsys.readouterr()
    assert _finetune(etl, tmp_path / "bad", "sparse_time_distillation=1.5") != 0
    assert "sparse_time_distillation must lie in [0, 1] or be null, got 1.5" in error_line(capsys.readouterr().err)


def _tuning_like(seed: int, patients: int = 300, per_patient: int = 3, labels: int = 12) -> tuple:
    """Targets ``(N, L)``, a patient id per sample, and a score that ranks the targets somewhat (N = 900)."""
    rng = np.random.default_rng(seed)
    patient = np.repeat(np.arange(patients), per_patient)
    y = rng.random((len(patient), labels)) < 0.15
    signal = y + rng.normal(0.0, 1.0, y.shape)
    return y, patient, signal


def test_labels_alone_replace_the_preferred_weight_only_when_clearly_better_on_the_tuning_patients() -> None:
    y, patient, signal = _tuning_like(seed=0)
    rng = np.random.default_rng(1)
    sharp, blurred = signal, signal + rng.normal(0.0, 1.5, signal.shape)  # the same ranking, less or more noise
    clearly = choose_weight(y, {0.0: sharp, 0.8: blurred}, patient)
    assert clearly.weight == 0.0
    difference, low, high = clearly.over_preferred[0.0]
    assert 0 < low <= difference <= high
    assert difference == pytest.approx(clearly.macro_ap[0.0] - clearly.macro_ap[0.8], abs=2e-5)
    # a hair better on the point estimate, within the noise of 300 patients: the preferred weight stands
    nudged = blurred + rng.normal(0.0, 0.05, signal.shape)
    close = choose_weight(y, {0.0: nudged, 0.8: blurred}, patient)
    low_close = close.over_preferred[0.0][1]
    assert low_close <= 0 and close.weight == 0.8
    # worse: the preferred weight stands whatever the interval
    assert choose_weight(y, {0.0: blurred, 0.8: sharp}, patient).weight == 0.8


def test_the_preferred_weight_follows_the_learner_that_led_the_first_comparison() -> None:
    teacher_led = PathLead(0.2410, 0.2450, (-0.0040, -0.0090, 0.0010))
    deep_led = PathLead(0.2510, 0.2465, (0.0045, -0.0010, 0.0100))  # the clinical case: ahead, not clearly
    assert preferred_weight(teacher_led) == PREFERRED_WEIGHT == 0.8 and preferred_weight(None) == 0.8
    assert preferred_weight(deep_led) == 0.0
    y, patient, signal = _tuning_like(seed=3)
    rng = np.random.default_rng(4)
    blurred = signal + rng.normal(0.0, 1.5, signal.shape)
    nudged = blurred + rng.normal(0.0, 0.05, signal.shape)
    # with labels alone preferred, a distilled run a hair better within the noise does not replace it
    close = choose_weight(y, {0.0: blurred, 0.8: nudged}, patient, preferred=0.0)
    assert close.weight == 0.0 and close.preferred == 0.0 and set(close.over_preferred) == {0.8}
    assert close.over_preferred[0.8][1] <= 0
    # a clearly better distilled run does
    clearly = choose_weight(y, {0.0: blurred, 0.8: signal}, patient, preferred=0.0)
    assert clearly.weight == 0.8 and clearly.over_preferred[0.8][1] > 0


def test_without_the_preferred_weight_the_first_run_stands_and_nothing_is_compared() -> None:
    y, patient, signal = _tuning_like(seed=2)
    choice = choose_weight(y, {0.0: signal}, patient)
    assert choice.weight == 0.0 and choice.over_preferred == {}
    assert choice.macro_ap[0.0] == pytest.approx(macro_average_precision(y, signal), abs=1e-5)


CHAINS = ("model.state_path=2", "model.state_path_copies=1", "state_path_max_epochs=2")
"""A small state path (the shared fast trainer settings switch it off)."""


@pytest.mark.parametrize(
    ("left", "first", "second", "expected"),
    [
        (600.0, 200.0, True, 600.0 - ROOM_MARGIN * 200.0),  # room kept for a second training
        (600.0, 200.0, False, 600.0),  # no second training possible: the chains get all
        (ROOM_MARGIN * 200.0 + MIN_CHAIN_SECONDS + 1, 200.0, True, MIN_CHAIN_SECONDS + 1),  # just enough to spare
        (ROOM_MARGIN * 200.0 + MIN_CHAIN_SECONDS - 1, 200.0, True, ROOM_MARGIN * 200.0 + MIN_CHAIN_SECONDS - 1),
        (100.0, 200.0, True, 100.0),  # no room either way
        (None, 200.0, True, None),  # no budget
    ],
)
def test_the_chains_leave_room_for_a_second_training_only_when_they_keep_a_useful_fit(
    left: float | None, first: float, second: bool, expected: float | None
) -> None:
    got = chains_seconds(left, first, second)
    assert got == (None if expected is None else pytest.approx(expected))
    if got is not None and left is not None and got < left:  # what is kept fits a second training's room check
        assert room_for_another(left - got, first)


def test_finetune_gives_the_chains_the_time_the_rule_allows_and_records_what_it_kept(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple] = []
    given: list[float | None] = []

    def rule(left: float | None, first: float, second: bool) -> float | None:
        asked.append((left, first, second))
        return None if left is None else left - 30.0

    def spy(model, train, tuning, seconds_left, *args, **kwargs):  # type: ignore[no-untyped-def]
        given.append(seconds_left)
        return fit_state_path(model, train, tuning, seconds_left, *args, **kwargs)

    monkeypatch.setattr("pipelines.finetune.chains_seconds", rule)
    monkeypatch.setattr("pipelines.finetune.fit_state_path", spy)
    monkeypatch.setattr("pipelines.finetune.room_for_another", lambda left, first: False)
    out = tmp_path / "ft"
    assert _finetune(etl, out, *CHAINS) == 0
    metrics = read_metrics(out)
    ((left, first, second),) = asked
    assert second is True  # the grid has a second weight
    assert first == metrics["train_seconds"] and 0 < left <= 12 * 60
    assert given == [pytest.approx(left - 30.0)]
    assert metrics["state_path"]["seconds_kept_for_second_training"] == pytest.approx(30.0, abs=0.1)


def test_with_one_distillation_weight_the_chains_are_not_held_back(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def rule(left: float | None, first: float, second: bool) -> float | None:
        asked.append(second)
        return chains_seconds(left, first, second)

    monkeypatch.setattr("pipelines.finetune.chains_seconds", rule)
    out = tmp_path / "ft"
    assert _finetune(etl, out, *CHAINS, "sparse_time_distillation=0") == 0
    assert asked == [False]
    assert "seconds_kept_for_second_training" not in read_metrics(out)["state_path"]


def test_the_first_training_holds_back_the_chains_share_of_the_budget_only_with_chains(
    etl: Path, tmp_path: Path
) -> None:
    """``state_path_time_share`` of the 12-minute budget is held back by the first training's budget (and reported),
    not by the validations' reserve the later choices subtract; without chains nothing is held back."""
    with_chains, without = tmp_path / "chains", tmp_path / "none"
    assert _finetune(etl, with_chains, *CHAINS, "sparse_time_distillation=0", "state_path_time_share=0.25") == 0
    assert _finetune(etl, without, "sparse_time_distillation=0", "state_path_time_share=0.25") == 0
    metrics = read_metrics(with_chains)
    assert metrics["time_budget_held_back_seconds"] == pytest.approx(0.25 * 12 * 60)
    assert metrics["time_budget_reserved_seconds"] < 60  # a few tiny validations' worth, apart from the share
    assert metrics["state_path"]["fitted"]
    assert read_metrics(without)["time_budget_held_back_seconds"] == 0.0
