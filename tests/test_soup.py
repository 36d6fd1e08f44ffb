"""The checkpoint soup: fine-tuning keeps the average of its best checks' weights when tuning says so."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.training.checkpoints import load_checkpoint
from behrt_rope.training.soup import TopChecksSoup, average_states
from pipelines.finetune import MONITORS, _try_soup
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, error_line, read_metrics


@pytest.fixture(scope="module", params=["loss", "macro_ap"])
def soup_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("soup")
    etl = build_etl(root, patients=120)
    out = root / "ft"
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "4", "task.min_label_count=2"]
    overrides = ["checkpoint_soup=2", "trainer.learning_rate=0.01", "trainer.early_stopping_patience=0"]
    # one training, so that OUT/logs are the saved model's (the distillation choice is tested apart)
    overrides.append("sparse_time_distillation=0")
    assert main([*argv, *TINY_MODEL, *FAST_TRAINER, *overrides, f"select_by={request.param}"]) == 0
    return out, request.param


def _tuning_curve(out: Path, metric: str) -> list[tuple[int, float]]:
    """(epoch, metric) of every check logged while fitting (the final validations have no epoch row)."""
    with open(out / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(metric)]
    return [(int(r["epoch"]), float(r[metric])) for r in rows]


def test_the_soup_averages_the_best_checks_and_the_model_is_what_tuning_chose(soup_run: tuple[Path, str]) -> None:
    out, select_by = soup_run
    report = read_metrics(out)["checkpoint_soup"]
    metric = MONITORS[select_by][0]
    assert report["monitor"] == metric
    curve = _tuning_curve(out, metric)[:4]  # the 4 epochs' checks; later rows are the soup's and final validations
    best_two = sorted(curve, key=lambda c: c[1] if select_by == "loss" else -c[1])[:2]
    assert report["epochs"] == [epoch + 1 for epoch, _ in best_two]
    assert report["best_epoch"] == pytest.approx(best_two[0][1], abs=1e-5)
    state = load_checkpoint(out / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT)["callbacks"]["TopChecksSoup"]
    checks = state["checks"]
    assert [c["epoch"] for c in checks] == [epoch for epoch, _ in best_two], "the checkpoint carries the checks"
    expected = average_states([c["state"] for c in checks]) if report["kept"] else checks[0]["state"]
    saved = safetensors.torch.load_file(str(out / S.MODEL_WEIGHTS_FILE))
    name = "classifier.weight"
    torch.testing.assert_close(saved[name], expected[f"model.{name}"])
    better = report["soup"] <= report["best_epoch"] if select_by == "loss" else report["soup"] >= report["best_epoch"]
    assert report["kept"] == better


def test_the_kept_checks_differ_so_the_soup_is_not_one_of_them(soup_run: tuple[Path, str]) -> None:
    out, _ = soup_run
    checks = load_checkpoint(out / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT)["callbacks"]["TopChecksSoup"]["checks"]
    a, b = (c["state"]["model.classifier.weight"] for c in checks)
    assert not torch.allclose(a, b)


def _checks(scores: list[float], monitor: str = "val/macro_ap", mode: str = "max") -> TopChecksSoup:
    soup = TopChecksSoup(2, monitor, mode)
    soup.checks = [
        (s, i, {"weight": torch.full((2, 3), float(i)), "bias": torch.zeros(2)}) for i, s in enumerate(scores)
    ]
    return soup


@pytest.mark.parametrize(("soup_score", "kept"), [(0.51, True), (0.50, True), (0.49, False)])
def test_the_soup_is_kept_only_when_tuning_is_at_least_the_best_check(soup_score: float, kept: bool) -> None:
    soup = _checks([0.50, 0.45])
    trainer = SimpleNamespace(validate=lambda *a, **k: [{"val/macro_ap": soup_score, "val/loss": 9.0}])
    model, report = _try_soup(soup, lambda: torch.nn.Linear(3, 2), trainer, None)  # type: ignore[arg-type]
    assert report["checkpoint_soup"]["kept"] is kept
    assert report["checkpoint_soup"]["epochs"] == [1, 2]
    assert torch.equal(model.weight, torch.full((2, 3), 0.5 if kept else 0.0))


@pytest.mark.parametrize(("soup_loss", "kept"), [(0.29, True), (0.30, True), (0.31, False)])
def test_by_loss_the_soup_is_kept_only_when_its_loss_is_at_most_the_best_checks(soup_loss: float, kept: bool) -> None:
    soup = _checks([0.30, 0.35], monitor="val/loss", mode="min")
    trainer = SimpleNamespace(validate=lambda *a, **k: [{"val/macro_ap": 0.0, "val/loss": soup_loss}])
    _, report = _try_soup(soup, lambda: torch.nn.Linear(3, 2), trainer, None)  # type: ignore[arg-type]
    assert report["checkpoint_soup"]["kept"] is kept and report["checkpoint_soup"]["monitor"] == "val/loss"


def test_the_callback_keeps_the_k_best_and_survives_a_checkpoint_round_trip() -> None:
    soup = TopChecksSoup(2)
    fitting = SimpleNamespace(fn="fit", sanity_checking=False)
    for epoch, score in enumerate([0.2, 0.5, float("nan"), 0.4, 0.1]):
        trainer = SimpleNamespace(
            state=fitting,
            sanity_checking=False,
            callback_metrics={"val/macro_ap": torch.tensor(score)},
            current_epoch=epoch,
        )
        soup.on_validation_end(trainer, torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    assert soup.epochs == [1, 3]
    restored = TopChecksSoup(2)
    restored.load_state_dict(soup.state_dict())
    assert restored.epochs == [1, 3] and [s for s, _, _ in restored.checks] == pytest.approx([0.5, 0.4])


def test_checks_outside_fitting_do_not_count() -> None:
    soup = TopChecksSoup(2)
    for fn, sanity in (("validate", False), ("fit", True)):
        state = SimpleNamespace(fn=fn)
        trainer = SimpleNamespace(
            state=state, sanity_checking=sanity, callback_metrics={"val/macro_ap": torch.tensor(0.9)}, current_epoch=0
        )
        soup.on_validation_end(trainer, torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    assert soup.checks == []


def test_states_with_different_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="same keys"):
        average_states([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="k >= 1"):
        TopChecksSoup(0)


def test_a_soup_size_below_one_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    etl = build_etl(tmp_path, patients=40)
    argv = [
        "finetune",
        "--data",
        str(etl),
        "--out",
        str(tmp_path / "ft"),
        "checkpoint_soup=0",
        *TINY_MODEL,
        *FAST_TRAINER,
    ]
    assert main(argv) != 0
    assert "checkpoint_soup must be >= 1" in error_line(capsys.readouterr().err)


def test_by_loss_the_callback_keeps_the_lowest() -> None:
    soup = TopChecksSoup(2, monitor="val/loss", mode="min")
    for epoch, loss in enumerate([0.5, 0.3, 0.4, 0.6]):
        metrics = {"val/loss": torch.tensor(loss)}
        trainer = SimpleNamespace(
            state=SimpleNamespace(fn="fit"), sanity_checking=False, callback_metrics=metrics, current_epoch=epoch
        )
        soup.on_validation_end(trainer, torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    assert soup.epochs == [1, 2]
