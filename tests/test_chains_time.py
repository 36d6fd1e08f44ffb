"""The chains' share of fine-tuning's time budget, decided before the deep part trains (``training/chains_time.py``),
and the chains' fit split in two around it (``state_path_fit.start_first_set``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.chains_time import RIVAL_TIME_SHARE, chains_time
from behrt_rope.training.inference import multilabel_model, score_parts
from behrt_rope.training.state_path_fit import FirstSet, _Best, _SetFit, fit_state_path, start_first_set
from behrt_rope.training.tasks import macro_average_precision
from tests.fixtures_training import build_finetuned, read_metrics, split_data

CHAINS = ("model.state_path=2", "model.state_path_copies=2", "state_path_max_epochs=2", "state_path_time_share=null")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chains_time")
    return root, build_finetuned(root, 160, 7, *CHAINS)[1]


def test_finetune_decides_the_chains_time_and_goes_on_from_their_started_first_set(
    fitted: tuple[Path, Path],
) -> None:
    """With ``state_path_time_share`` null the first set is started before the deep part trains, the
    decision and both scores are recorded, the first training holds back exactly the share decided, and the first
    set's start is the chains' fit's first set's (not redone)."""
    metrics = read_metrics(fitted[1])
    rule = metrics["state_path"]["time_rule"]
    rivals = rule["first_set_tuning_macro_ap"] >= rule["sparse_time_path_tuning_macro_ap"]
    assert rule["chains_rival"] == rivals
    budget = metrics["time_budget_minutes"] * 60
    assert rule["share"] == pytest.approx(
        RIVAL_TIME_SHARE - rule["first_set_seconds"] / budget if rivals else 0.0, abs=1e-3
    )
    assert metrics["time_budget_held_back_seconds"] == pytest.approx(
        rule["share"] * metrics["time_budget_minutes"] * 60
    )
    assert 0.0 < rule["first_set_tuning_macro_ap"] <= 1.0 and rule["first_set_seconds"] > 0
    sets = metrics["state_path"]["sets"]
    assert sets[0]["prefit"]["epochs"] >= 1 and sets[1]["prefit"]["epochs"] >= 1


def test_the_chains_fit_goes_on_from_the_started_first_set(fitted: tuple[Path, Path]) -> None:
    """The started first set is the first epoch of the fit in one go (same seed: same chains, same score), and the
    fit that goes on from it counts that epoch, keeps its start and does not start the set again."""
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    train, tuning = split_data(root, bundle, S.TRAIN), split_data(root, bundle, S.TUNING)

    def fit(max_epochs: int, split: bool) -> tuple[dict, dict, FirstSet | None]:
        model = multilabel_model(bundle)
        assert model.state_path is not None
        first = start_first_set(model, train, tuning, prefit_epochs=5, seed=3) if split else None
        report = fit_state_path(
            model,
            train,
            tuning,
            None,
            max_epochs=max_epochs,
            seed=3,
            choose_share=False,
            prefit_epochs=5,
            first_set=first,
        )
        return report, model.state_path.state_dict(), first

    one_go, one_go_state, _ = fit(1, split=False)
    split, split_state, first = fit(1, split=True)
    assert first is not None and first.fit.epochs == 1
    assert all(torch.equal(value, split_state[key]) for key, value in one_go_state.items())
    assert split["sets"] == one_go["sets"]
    assert first.tuning_macro_ap == pytest.approx(one_go["sets"][0]["tuning_macro_ap"], abs=1e-5)
    on, _, first = fit(3, split=True)
    assert first is not None
    assert on["sets"][0]["epochs"] == 3 and on["sets"][0]["prefit"] == first.fit.prefit
    assert on["sets"][0]["tuning_macro_ap"] >= first.tuning_macro_ap


def test_the_started_first_set_leaves_the_chains_frozen_and_the_model_as_it_was(fitted: tuple[Path, Path]) -> None:
    """The deep part trains after the start: its optimizer must not see the chains, and the model's scores must not
    move (the path's share is 0 and its sets keep their weights)."""
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    assert model.state_path is not None
    tuning = split_data(root, bundle, S.TUNING)
    model.state_path.set_share(0.0)
    before = score_parts(model, tuning.seqs, parts=("model",))["model"]
    weights = model.state_path.copy_weight.clone()
    first = start_first_set(model, split_data(root, bundle, S.TRAIN), tuning, prefit_epochs=2)
    assert not any(p.requires_grad for p in model.state_path.parameters())
    assert torch.equal(model.state_path.copy_weight, weights)
    assert first.fit.prefit is not None and first.fit.prefit["epochs"] >= 1 and first.fit.epochs == 1
    assert 0.0 < first.tuning_macro_ap <= 1.0
    assert (score_parts(model, tuning.seqs, parts=("model",))["model"] == before).all()


@pytest.mark.parametrize(
    ("margin", "budget", "share"),
    [
        (0.01, None, RIVAL_TIME_SHARE),
        (0.0, None, RIVAL_TIME_SHARE),
        (0.0, 10.0, RIVAL_TIME_SHARE - 0.1),  # the first set took 1 s of 10: a tenth of the budget already spent
        (0.0, 2.0, 0.0),  # it took more than the chains' share: nothing more held back
        (-0.01, 10.0, 0.0),
    ],
)
def test_time_is_held_back_only_when_the_first_set_rivals_the_sparse_time_path(
    fitted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, margin: float, budget: float | None, share: float
) -> None:
    """The first set's tuning macro AP against the sparse time path's alone, scored here: at or above it the
    chains get :data:`RIVAL_TIME_SHARE` of the budget, what the first set took included; below it nothing."""
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    tuning = split_data(root, bundle, S.TUNING)
    path = score_parts(model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts, parts=("path",))["path"]
    path_ap = macro_average_precision(tuning.y, path)
    fit = _SetFit(_Best(macro_ap=path_ap + margin), epochs=1, stopped_by="", epoch_seconds=1.0)
    first = FirstSet(shared=0, fit=fit, seconds=1.0)
    monkeypatch.setattr("behrt_rope.training.chains_time.start_first_set", lambda *args, **kwargs: first)
    model.train()
    decided = chains_time(model, split_data(root, bundle, S.TRAIN), tuning, None, None, 0, 0, budget_seconds=budget)
    assert decided.share == pytest.approx(share) and decided.first_set is first
    assert decided.report["chains_rival"] == (margin >= 0)
    assert all(module.training for module in model.modules())  # left as found: the deep part trains next
    assert decided.report["sparse_time_path_tuning_macro_ap"] == pytest.approx(path_ap, abs=1e-5)


def test_a_fixed_share_is_kept_and_starts_nothing(fitted: tuple[Path, Path]) -> None:
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    decided = chains_time(
        multilabel_model(bundle), split_data(root, bundle, S.TRAIN), split_data(root, bundle, S.TUNING), 0.2, None, 0, 0
    )
    assert decided.share == 0.2 and decided.first_set is None and decided.report["chosen_by"] == "state_path_time_share"
