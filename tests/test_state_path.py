"""The state path: hidden-state chains fitted apart from the deep part and mixed in at a tuning-chosen share."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.data.datasets import labelled_dataset
from behrt_rope.data.sequences import load_tokens
from behrt_rope.errors import UserError
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.model.state_path import StatePath
from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID
from behrt_rope.training.bundle import ADDED_LATER, load_bundle, save_bundle
from behrt_rope.training.chain_pairs import paired_chains
from behrt_rope.training.inference import multilabel_model, score_parts
from behrt_rope.training.sparse_time_fit import logit
from behrt_rope.training.state_path_fit import (
    EQUAL_SHARE,
    SHARE_GRID,
    _record_nll,
    _train,
    fit_state_path,
    set_state_path_share,
)
from behrt_rope.training.state_path_prefit import emitted_codes
from behrt_rope.training.tasks import macro_average_precision
from behrt_rope.training.tuning_logits import TuningLogits
from pipelines.evaluate import ablation_parts
from pipelines.finetune import Config, run
from tests.fixtures_training import build_finetuned, read_metrics, split_data

A, B = N_SPECIAL, N_SPECIAL + 1
VOCAB = N_SPECIAL + 4


def _batch():
    """One patient: visits recording A, then B, then A and B, at ages 40, 41 and 43.5."""
    ids = torch.tensor([[CLS_ID, A, SEP_ID, B, SEP_ID, A, B, SEP_ID]])
    visit = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    ages = torch.tensor([[40.0, 40.0, 40.0, 41.0, 41.0, 43.5, 43.5, 43.5]])
    return ids, visit, ages, ids == SEP_ID, torch.full_like(ids, 1)


def test_the_model_mixes_the_state_path_in_at_its_share_and_not_at_share_zero():
    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, age_heads=0, state_path=3
    )
    torch.manual_seed(0)
    model = BehrtForMultiLabel(cfg, num_labels=2, label_token_ids=[A, B]).eval()
    assert model.state_path is not None and model.sparse_time is not None
    assert not any(p.requires_grad for p in model.state_path.parameters())  # the deep training leaves it alone
    ids, visit, ages, score_at, sex = _batch()
    args = (ids, ages, torch.zeros_like(ids), visit, None, score_at, sex)
    with torch.no_grad():
        model.sparse_time.bias.fill_(0.7)  # a path that adds something of its own
        deep, path = model.deep_logits(*args), model.path_logits(ids, visit, ages, score_at, sex)
        states = model.state_logits(ids, visit, ages, score_at, sex)
        base = 0.5 * deep + 0.5 * path
        assert not model.uses_state_path  # share 0 until finetune sets it
        torch.testing.assert_close(model(*args), base)
        model.state_path.set_share(0.3)
        assert model.uses_state_path
        torch.testing.assert_close(model(*args), 0.7 * base + 0.3 * states)
    with pytest.raises(ValueError, match="state path's share"):
        model.state_path.set_share(1.5)
    with pytest.raises(ValueError, match="state_path"):
        ModelConfig(vocab_size=VOCAB, state_path=1)


def _share_case(states_noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tuning targets ``(N, L)``, patients ``(N,)`` and two logit arrays of one truth: the model's (``base``) and
    the chains' (``states``, ``states_noise`` times the model's noise); each sample its own patient."""
    rng = np.random.default_rng(seed)
    n, labels = 2000, 6
    truth = rng.normal(-2.0, 1.5, (n, labels))
    y = (rng.random((n, labels)) < 1 / (1 + np.exp(-truth))).astype(np.float32)
    base = truth + rng.normal(0, 1.0, truth.shape)
    states = truth + rng.normal(0, states_noise, truth.shape)
    return y, np.arange(n), base, states


def _model_with_state_path() -> BehrtForMultiLabel:
    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, age_heads=0, state_path=3
    )
    return BehrtForMultiLabel(cfg, num_labels=6)


@pytest.mark.parametrize(("states_noise", "comparable"), [(1.0, True), (3.0, False)])
def test_chains_as_good_as_the_model_are_mixed_in_equally_and_weak_ones_kept_out(states_noise, comparable):
    """Chains of the model's own strength (independent errors): not clearly worse, so the reference is the equal
    mix, which no share beats clearly; chains three times as noisy: clearly worse, share 0 as before."""
    y, patients, base, states = _share_case(states_noise)
    model = _model_with_state_path()
    report = set_state_path_share(model, None, y, patients, base, states)
    assert report["chains_comparable"] is comparable
    expected = EQUAL_SHARE if comparable else 0.0
    assert report["reference_share"] == expected and report["share"] == expected
    assert float(model.state_path.share) == pytest.approx(expected)
    scores = report["tuning_macro_ap_by_share"]
    # the equal mix of two learners with independent errors beats either alone; the noisy chains only drag
    if comparable:
        assert scores[EQUAL_SHARE] > max(scores[0.0], scores[1.0])
        assert set(report[f"over_share_{EQUAL_SHARE:g}"]) == {"level"} | {f"{w:g}" for w in SHARE_GRID} - {"0.5"}
    else:
        assert scores[1.0] < scores[0.0] and f"over_share_{EQUAL_SHARE:g}" not in report


def test_chains_clearly_better_than_the_equal_mix_take_the_larger_share():
    """Chains far better than the model: a share above the equal mix is clearly better than it, and is kept."""
    y, patients, base, states = _share_case(0.2)
    model = _model_with_state_path()
    report = set_state_path_share(model, None, y, patients, base, states)
    assert report["chains_comparable"] and report["share"] > EQUAL_SHARE
    assert report[f"over_share_{EQUAL_SHARE:g}"][f"{report['share']:g}"]["low"] > 0


def test_the_l1_penalty_leaves_each_label_s_own_code_free():
    path = StatePath(VOCAB, num_labels=2, num_states=3, label_token_ids=[A, B])
    evidence = path.chains[0].evidence
    with torch.no_grad():
        evidence.zero_()
        view = evidence.view(VOCAB, 2, 3)
        view[A, 0] = 5.0  # label 0's own code
        view[B, 1] = -4.0  # label 1's own code
        assert path.cross_evidence_l1().item() == 0.0
        view[B, 0] = torch.tensor([1.0, -2.0, 0.5])  # label 1's code on label 0's chain
        view[N_SPECIAL + 3, 1, 0] = 1.5  # a code that is no label's, on label 1's chain
    assert path.cross_evidence_l1().item() == pytest.approx((3.5 + 1.5) / 2)  # per label
    unknown = StatePath(VOCAB, num_labels=2, num_states=3)  # own codes not given yet: every code counts
    with torch.no_grad():
        unknown.chains[0].evidence.copy_(evidence)
    assert unknown.cross_evidence_l1().item() == pytest.approx((3 * 5 + 3 * 4 + 3.5 + 1.5) / 2)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("state_path")
    settings = ("model.state_path=2", "model.state_path_copies=2", "state_path_max_epochs=3")
    return root, build_finetuned(root, 160, 5, *settings)[1]


def test_finetune_fits_the_path_and_keeps_the_share_tuning_scores_best(fitted: tuple[Path, Path]):
    root, model_dir = fitted
    report = read_metrics(model_dir)["state_path"]
    assert report["fitted"] and report["sets_fitted"] == 2 and len(report["sets"]) == 2
    assert all(1 <= s["epochs"] <= 3 and 0 <= s["best_epoch"] < s["epochs"] for s in report["sets"])
    assert report["epochs"] == sum(s["epochs"] for s in report["sets"])
    scores = {float(w): v for w, v in report["tuning_macro_ap_by_share"].items()}
    assert set(scores) == set(SHARE_GRID)
    # the reference share (an equal mix where the chains alone are not clearly worse than the model, else 0)
    # unless a share's paired interval over the tuning patients lies above it; then the largest such gain
    over = {float(w): d for w, d in report["over_share_0"].items() if w != "level"}
    assert set(over) == set(SHARE_GRID) - {0.0}
    assert report["chains_comparable"] == (over[1.0]["high"] >= 0)
    reference = EQUAL_SHARE if report["chains_comparable"] else 0.0
    assert report["reference_share"] == reference
    against = {float(w): d for w, d in report[f"over_share_{reference:g}"].items() if w != "level"}
    assert set(against) == set(SHARE_GRID) - {reference}
    clear = {w: d["difference"] for w, d in against.items() if d["low"] > 0}
    assert report["share"] == (max(clear, key=clear.get) if clear else reference)
    # the bundle carries the fitted chains and the share: the model's scores are the mix they make
    model = multilabel_model(load_bundle(model_dir, "multilabel"))
    assert model.state_path is not None and float(model.state_path.share) == pytest.approx(report["share"])
    assert model.state_path.copy_weight.tolist() == [0.5, 0.5]  # both sets fitted, weighed equally
    # label codes that travel together in the train patients share a chain, in every set, saved in the bundle
    expected = paired_chains(load_tokens(root / "etl").split(S.TRAIN), model.state_path.label_token_ids.numpy())
    renumbered = np.unique(expected, return_inverse=True)[1]  # the chains no label reads are dropped
    assert all(chains.chain_of_label.tolist() == renumbered.tolist() for chains in model.state_path.chains)
    assert all(chains.num_chains == len(np.unique(expected)) < len(expected) for chains in model.state_path.chains)
    assert report["shared_chains"] == len(expected) - len(np.unique(expected))
    tuning = load_tokens(root / "etl").split(S.TUNING)
    parts = score_parts(model, tuning, parts=("model", "deep", "path", "states"))
    p, s = float(model.sparse_time.share), report["share"]
    mixed = (1 - s) * ((1 - p) * logit(parts["deep"]) + p * logit(parts["path"])) + s * logit(parts["states"])
    np.testing.assert_allclose(logit(parts["model"]), mixed, rtol=1e-4, atol=1e-4)
    # the two sets were fitted apart: each scores on its own, and the path is their mean
    where = _scored_batch(tuning, model)
    one, other = (chains(*where) for chains in model.state_path.chains)
    assert not torch.allclose(one, other, atol=1e-3)
    torch.testing.assert_close(model.state_path(*where), 0.5 * one + 0.5 * other)
    # the chains were trained: their scores differ from a fresh path's
    fresh = StatePath(model.config.vocab_size, model.num_labels, 2, copies=2)
    model.state_path.chains.load_state_dict(fresh.chains.state_dict())
    assert not np.allclose(score_parts(model, tuning, parts=("states",))["states"], parts["states"], atol=1e-3)


@pytest.mark.parametrize("share", [0.0, 0.4])
def test_the_learned_parts_are_the_model_without_its_sparse_time_path(fitted: tuple[Path, Path], share: float):
    """``learned`` mixes the deep part and the chains at the chains' share and leaves the sparse time path out;
    with the chains at share 0 it is the deep part, and ``evaluate`` then does not score it as an ablation."""
    root, model_dir = fitted
    model = multilabel_model(load_bundle(model_dir, "multilabel"))
    assert model.state_path is not None and model.sparse_time is not None
    model.state_path.set_share(share)
    tuning = load_tokens(root / "etl").split(S.TUNING)
    parts = score_parts(model, tuning, parts=("learned", "deep", "states", "model"))
    assert list(parts) == ["learned", "deep", "states", "model"]
    mixed = (1 - share) * logit(parts["deep"]) + share * logit(parts["states"])
    np.testing.assert_allclose(logit(parts["learned"]), mixed, rtol=1e-4, atol=1e-4)
    assert not np.allclose(parts["learned"], parts["model"], atol=1e-4)  # the path's share is above 0
    assert ablation_parts(model) == (("model", "deep", "learned") if share else ("model", "deep"))


def test_the_tuning_figures_finetune_records_are_the_saved_models(fitted: tuple[Path, Path]):
    """``finetune`` scores the tuning split once per run and derives its choices and their report from those
    logits (training/tuning_logits.py): the figures it records are the saved model's, scored afresh."""
    root, model_dir = fitted
    metrics = read_metrics(model_dir)
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    tuning = split_data(root, bundle, S.TUNING)
    probs = score_parts(model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts)["model"]
    assert metrics["tuning_macro_ap"] == pytest.approx(macro_average_precision(tuning.y, probs), abs=2e-5)
    p = np.clip(probs.astype(np.float64), 1e-12, 1 - 1e-12)
    assert metrics["tuning_loss"] == pytest.approx(
        -np.mean(tuning.y * np.log(p) + (1 - tuning.y) * np.log1p(-p)), rel=1e-3
    )
    # the chains alone, as fitted: their figure comes from the same pass, not from a scoring pass of their own
    # (ranked by logits: chains sure of a label put probabilities within float32's spacing of 1, which ties them)
    states = score_parts(model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts, parts=("states",), logits=True)
    states = states["states"]
    alone = metrics["state_path"]["tuning_macro_ap_alone"]
    assert alone == pytest.approx(macro_average_precision(tuning.y, states), abs=2e-5)
    # the cache mixes its parts as the model does, at the shares the model carries
    scores = TuningLogits.score(model, tuning, torch.device("cpu"), 0.0, with_states=True)
    assert scores.path is not None and scores.states is not None and set(scores.deep) == {0.0}
    np.testing.assert_allclose(1 / (1 + np.exp(-scores.model_logits(model, 0.0))), probs, atol=1e-5)
    report = scores.report(model, 0.0, None)
    assert report["tuning_macro_ap"] == pytest.approx(metrics["tuning_macro_ap"], abs=2e-5)
    assert report["tuning_loss"] == pytest.approx(metrics["tuning_loss"], abs=2e-5)
    # positives weighed up raise the loss of a model that misses some of them
    assert scores.report(model, 0.0, torch.full((model.num_labels,), 5.0))["tuning_loss"] > report["tuning_loss"]


def _scored_batch(seqs, model: BehrtForMultiLabel) -> tuple[torch.Tensor, ...]:
    """The state path's inputs for the first 8 patients of ``seqs``, every visit scored."""

    rows = np.arange(8)
    data, collate = labelled_dataset(seqs, rows, seqs.lengths[rows], None, None, model.pooling)
    batch = collate([data[i] for i in range(len(data))])
    return batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"], batch["sex"]


def test_a_path_weighs_only_its_fitted_sets_and_loads_a_one_set_bundle():
    torch.manual_seed(0)
    path = StatePath(VOCAB, num_labels=2, num_states=3, label_token_ids=[A, B], copies=3)
    ids, visit, ages, score_at, sex = _batch()
    with torch.no_grad():
        first = path.chains[0](ids, visit, ages, score_at, sex)
        path.use_copies([True, False, False])  # the budget left sets 1 and 2 unfitted
        torch.testing.assert_close(path(ids, visit, ages, score_at, sex), first)
        with pytest.raises(ValueError, match="at least one set"):
            path.use_copies([False, False, False])
        # a bundle from before the sets (session 49): one filter under "chains.", no weights
        old = {k: v for k, v in path.state_dict().items() if not k.startswith("chains.") and k != "copy_weight"}
        old.update({"chains." + k: v for k, v in path.chains[0].state_dict().items()})
        loaded = StatePath(VOCAB, num_labels=2, num_states=3, label_token_ids=[A, B])
        loaded.load_state_dict(old)
        torch.testing.assert_close(loaded(ids, visit, ages, score_at, sex), first)
        assert loaded.copy_weight.tolist() == [1.0]


def test_a_model_keeps_its_chains_reach_and_one_saved_before_it_moves_between_any_states(tmp_path: Path):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=8, num_heads=2, num_layers=1, intermediate_size=16)
    ordered = BehrtForMultiLabel(dataclasses.replace(config, state_path=5, state_path_reach=1), 2)
    assert ordered.state_path is not None and ordered.state_path.chains[0].rate.shape == (2, 8)
    save_bundle(tmp_path, "multilabel", ordered.config, ordered.state_dict(), labels=["A", "B"], pooling="visit")
    (tmp_path / ".done").write_text("finetune")
    loaded = multilabel_model(load_bundle(tmp_path, "multilabel"))
    assert loaded.config.state_path_reach == 1
    ids, visit, ages, score_at, sex = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.state_path.chains[0](ids, visit, ages, score_at, sex),
            ordered.state_path.chains[0](ids, visit, ages, score_at, sex),
        )
    # saved before chains had a reach (session 68): any two states, as it was trained
    assert ADDED_LATER["state_path_reach"] == 0
    meta_path = tmp_path / "model.json"
    meta = json.loads(meta_path.read_text())
    del meta["model_config"]["state_path_reach"]
    meta_path.write_text(json.dumps(meta))
    assert load_bundle(tmp_path, "multilabel")["model_config"].state_path_reach == 0


def test_without_time_left_the_path_is_not_fitted_and_the_model_is_unchanged(fitted: tuple[Path, Path]):
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    tuning = split_data(root, bundle, S.TUNING)
    assert model.state_path is not None
    model.state_path.set_share(0.0)
    before = score_parts(model, tuning.seqs, parts=("model",))["model"]
    weights = {k: v.clone() for k, v in model.state_path.state_dict().items()}
    report = fit_state_path(model, split_data(root, bundle, S.TRAIN), tuning, seconds_left=0.0)
    assert report["fitted"] is False and report["share"] == 0.0 and "budget" in report["stopped_by"]
    assert all(torch.equal(v, model.state_path.state_dict()[k]) for k, v in weights.items())
    np.testing.assert_array_equal(score_parts(model, tuning.seqs, parts=("model",))["model"], before)


def test_a_set_whose_first_epoch_would_overrun_the_budget_is_not_started(fitted: tuple[Path, Path]):
    """The epoch time measured on the set before stands for the next set's first epoch."""
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    train, tuning = split_data(root, bundle, S.TRAIN), split_data(root, bundle, S.TUNING)
    device = torch.device("cpu")
    now = time.monotonic()
    late = _train(model, 1, train, tuning, now + 1000.0, 2000.0, 2e-4, 3, 0, False, device)
    assert late.epochs == 0 and late.best.weights is None and "budget" in late.stopped_by
    on_time = _train(model, 1, train, tuning, now + 1000.0, 0.0, 2e-4, 1, 0, False, device)
    assert on_time.epochs == 1 and on_time.best.weights is not None and on_time.epoch_seconds > 0


def test_the_record_term_keeps_the_chains_a_closer_model_of_their_codes_record(fitted: tuple[Path, Path]):
    """From the same start, the same batches and seed, a fit with the record term ends with a higher likelihood
    of the train split's record of each chain's own codes than the next-visit loss alone, and is recorded."""
    root, model_dir = fitted
    bundle = load_bundle(model_dir, "multilabel")
    train, tuning = split_data(root, bundle, S.TRAIN), split_data(root, bundle, S.TUNING)
    assert read_metrics(model_dir)["state_path"]["record_weight"] == 0.0  # the default (off), in metrics.json
    nll = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        model = multilabel_model(bundle)
        assert model.state_path is not None
        fit = _train(model, 0, train, tuning, None, 0.0, 2e-4, 3, 0, False, torch.device("cpu"), 0, weight)
        assert fit.best.weights is not None
        chains = model.state_path.chains[0]
        chains.load_state_dict(fit.best.weights)
        batch = train.collate([train.dataset[i] for i in range(len(train.dataset))])
        with torch.no_grad():
            nll[weight] = float(_record_nll(chains, batch, emitted_codes(chains, model.state_path.label_token_ids)))
    assert nll[1.0] < nll[0.0] - 0.01, nll


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("state_path_share", 1.5, "state_path_share must lie in \\[0, 1\\]"),
        ("sparse_time_share", -0.1, "sparse_time_share must lie in \\[0, 1\\]"),
        ("state_path_l1", -1e-4, "state_path_l1 must be >= 0"),
        ("state_path_max_epochs", -1, "state_path_max_epochs must be >= 0"),
        ("state_path_record_weight", -0.1, "state_path_record_weight must be >= 0"),
        ("state_path_time_share", 1.0, "state_path_time_share must lie in \\[0, 1\\)"),
        ("state_path_pair_correlation", 1.5, "state_path_pair_correlation must lie in \\[0, 1\\]"),
    ],
)
def test_finetune_rejects_a_bad_path_setting_before_reading_any_data(tmp_path: Path, setting, value, message):
    """The shares and the penalty are used only after the deep part is trained: a typo must not cost that."""
    config = Config(data=str(tmp_path / "no_such_etl"), out=str(tmp_path / "out"), **{setting: value})
    with pytest.raises(UserError, match=message):
        run(config)
    assert not (tmp_path / "out").exists()
