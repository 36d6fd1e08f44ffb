"""The sparse time path: the reference's binned design computed from the token stream, frozen fitted weights."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.data.batching import model_inputs
from behrt_rope.data.datasets import labelled_dataset
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.etl.config import EtlConfig, SplitConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.evaluation.sparse_time import (
    C_GRID,
    DEFAULT_C,
    SELECT_C,
    fit_sparse_time,
    own_design,
    shared_design,
)
from behrt_rope.evaluation.time_features import time_features
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel, multilabel_loss
from behrt_rope.model.sparse_time_path import SparseTimePath, shared_columns
from behrt_rope.training.bundle import ADDED_LATER
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.inference import _sample_ids, score, score_parts
from behrt_rope.training.sparse_time_fit import fit_path
from behrt_rope.training.tasks import MultiLabelTask
from tests.conftest import write_visits

# Gaps that sit exactly on the bin edges (days since: 30, 90, 365, 1,095; first record: 2,922 days = 8
# years; previous visit: 14, 30, 90, 365), and others.
GAPS = np.array([1, 14, 30, 31, 90, 200, 365, 366, 730, 1095, 1461, 2922])
CODES = ["A01", "B02", "C03", "D04", "E05", "F06"]


def _cohort(tmp_path, n_patients: int = 40, seed: int = 0):
    """A random visits-format cohort through the ETL; returns sequences, samples and ``label_of_token``."""
    rng = np.random.default_rng(seed)
    patients, events = [], []
    for p in range(n_patients):
        birth = pd.Timestamp("1950-01-01") + pd.Timedelta(days=int(rng.integers(0, 20_000)))
        patients.append({S.PATIENT_ID: f"p{p}", S.BIRTH_DATE: birth.date().isoformat(), S.SEX: "FMOU"[p % 4]})
        day = birth + pd.Timedelta(days=int(rng.integers(300, 20_000)))
        for _ in range(int(rng.integers(2, 9))):
            for code in rng.choice(CODES, size=int(rng.integers(1, 4)), replace=False):
                events.append({S.PATIENT_ID: f"p{p}", S.DATE: day.date().isoformat(), S.CODE: code})
            day += pd.Timedelta(days=int(rng.choice(GAPS)))
    raw = write_visits(tmp_path / "raw", patients, events)
    run_etl(raw, tmp_path / "etl", EtlConfig(split=SplitConfig(train=1.0, tuning=0.0, held_out=0.0)), progress=False)
    seqs, tokens = load_tokens(tmp_path / "etl"), load_vocabulary(tmp_path / "etl")["token"].tolist()
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    label_ids = np.array([tokens.index(c) for c in CODES[:5]])  # F06 is not a label: it must not count
    return seqs, samples, label_ids, label_index(label_ids, len(tokens))


def _path_features(seqs, samples, label_ids):
    """The torch path's own and shared columns for every sample, in sample order."""
    dataset, collate = labelled_dataset(seqs, samples.rows, samples.cuts, None, None, "visit")
    batch = collate([dataset[i] for i in range(len(dataset))])
    path = SparseTimePath(len(label_ids), label_ids.tolist())
    own, shared = path.features(**_path_args(batch))
    order = np.argsort(_sample_ids(dataset, np.arange(len(dataset))))
    return own.numpy()[order], shared.numpy()[order], batch, order


def test_path_features_equal_the_reference_design(tmp_path):
    seqs, samples, label_ids, label_of_token = _cohort(tmp_path)
    features = time_features(seqs, samples, label_of_token)
    own, shared, _, _ = _path_features(seqs, samples, label_ids)
    assert own.shape == (len(samples), 5, 20) and shared.shape == (len(samples), shared_columns(5))
    for j in range(5):
        np.testing.assert_allclose(own[:, j], own_design(features, j), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(shared, shared_design(features).toarray(), rtol=1e-6, atol=1e-6)
    # the cohort reaches the edges it is meant to test: every gap bin and every years-since-first bin is used
    assert (shared[:, -5:].sum(0) > 0).all()
    assert (own[:, :, 14:19].sum((0, 1)) > 0).all()


def test_fitted_path_gives_the_references_logits_inside_the_model(tmp_path):
    seqs, samples, label_ids, label_of_token = _cohort(tmp_path, n_patients=80, seed=1)
    features = time_features(seqs, samples, label_of_token)
    fit = fit_sparse_time(features, targets(seqs, samples, label_of_token), c=1.0, n_jobs=1)
    assert (fit.shared_weight != 0).any() and (fit.own_weight != 0).any()
    config = ModelConfig(vocab_size=int(label_ids.max()) + 2, hidden_size=16, num_heads=2, intermediate_size=16)
    config.sparse_time, config.label_attention_heads = True, 0
    model = BehrtForMultiLabel(config, len(label_ids), label_token_ids=label_ids.tolist()).eval()
    assert model.sparse_time is not None
    model.sparse_time.load_fit(*(torch.from_numpy(a) for a in (fit.own_weight, fit.shared_weight, fit.bias)))
    _, _, batch, order = _path_features(seqs, samples, label_ids)
    with torch.no_grad():
        path_logits = model.sparse_time(**_path_args(batch)).numpy()[order]
        # the weights are buffers: saved with the model, never trained
        assert {"sparse_time.own_weight", "sparse_time.shared_weight", "sparse_time.bias"} <= set(model.state_dict())
        assert not any(name.startswith("sparse_time") for name, _ in model.named_parameters())
    np.testing.assert_allclose(path_logits, fit.logits(features), rtol=1e-4, atol=1e-4)


def test_fit_path_shows_its_progress_bar_only_when_asked(tmp_path, capfd):
    """``finetune`` passes ``trainer.progress_bar``: a run with bars off writes no bar to its log."""
    seqs, samples, label_ids, label_of_token = _cohort(tmp_path, n_patients=40, seed=2)
    y = targets(seqs, samples, label_of_token)
    config = ModelConfig(vocab_size=int(label_ids.max()) + 2, hidden_size=16, num_heads=2, intermediate_size=16)
    config.sparse_time, config.label_attention_heads = True, 0
    fitted = []
    for progress in (False, True):
        model = BehrtForMultiLabel(config, len(label_ids), label_token_ids=label_ids.tolist())
        fit_path(model, seqs, samples, label_of_token, y, c=1.0, progress=progress)
        shown = "sparse time regression" in capfd.readouterr().err
        assert shown is progress
        assert model.sparse_time is not None
        fitted.append(model.sparse_time.own_weight.clone())
    torch.testing.assert_close(fitted[0], fitted[1])  # the bar changes nothing else
    assert fitted[0].abs().sum() > 0


def test_fit_path_chooses_its_c_on_the_tuning_samples_unless_one_is_given(tmp_path):
    seqs, samples, label_ids, label_of_token = _cohort(tmp_path, n_patients=60, seed=3)
    y = targets(seqs, samples, label_of_token)
    config = ModelConfig(vocab_size=int(label_ids.max()) + 2, hidden_size=16, num_heads=2, intermediate_size=16)
    config.sparse_time, config.label_attention_heads = True, 0
    model = BehrtForMultiLabel(config, len(label_ids), label_token_ids=label_ids.tolist())
    chosen = fit_path(model, seqs, samples, label_of_token, y, None, False, tuning=(seqs, samples, y))["sparse_time_c"]
    by_c = {float(c): ap for c, ap in chosen["tuning_macro_ap"].items()}
    assert chosen["chosen_on"] == "tuning split" and list(by_c) == list(C_GRID)
    assert by_c[chosen["c"]] == max(by_c.values()) and chosen["tuning_labels"] == 5
    # the loaded weights are the fit at the chosen C
    fit = fit_sparse_time(time_features(seqs, samples, label_of_token), y, c=chosen["c"], n_jobs=1)
    assert model.sparse_time is not None
    np.testing.assert_allclose(model.sparse_time.shared_weight.numpy(), fit.shared_weight)
    no_tuning = fit_path(model, seqs, samples, label_of_token, y, None, False)["sparse_time_c"]
    rule = {"select_c": SELECT_C, "bins": "cumulative"}
    assert no_tuning == {"c": DEFAULT_C, "chosen_on": "default (no tuning samples)", **rule}
    fixed = fit_path(model, seqs, samples, label_of_token, y, 1.0, False, tuning=(seqs, samples, y))["sparse_time_c"]
    assert fixed == {"c": 1.0, "chosen_on": "fixed (sparse_time_c)", **rule}
    # one L1 fit on every column, as before the relaxed lasso: the loaded weights are that fit's
    one_fit = fit_path(model, seqs, samples, label_of_token, y, 1.0, False, select_c=None)["sparse_time_c"]
    assert one_fit["select_c"] is None
    plain = fit_sparse_time(time_features(seqs, samples, label_of_token), y, c=1.0, n_jobs=1, select_c=None)
    np.testing.assert_allclose(model.sparse_time.shared_weight.numpy(), plain.shared_weight)


def _path_args(batch):
    inputs = model_inputs(batch)
    return {k: inputs.get(k) for k in ("token_ids", "visit_index", "ages", "sex")} | {"score_at": batch["score_at"]}


def test_load_fit_checks_shapes_and_an_unfitted_path_adds_nothing():
    path = SparseTimePath(3, [5, 6, 7])
    with pytest.raises(ValueError, match=r"shared_weight must have shape \(3, 39\)"):
        path.load_fit(torch.zeros(3, 20), torch.zeros(3, 38), torch.zeros(3))
    ids = torch.tensor([[S.CLS_ID, 5, S.SEP_ID, 6, S.SEP_ID]])
    score_at = ids == S.SEP_ID
    logits = path(ids, torch.tensor([[0, 0, 0, 1, 1]]), torch.full((1, 5), 40.0), score_at)
    assert logits.shape == (2, 3) and not logits.any()


def test_bundles_written_before_the_path_load_without_it():
    assert ADDED_LATER["sparse_time"] is False


def _model_with_random_path(label_ids: np.ndarray, seed: int) -> BehrtForMultiLabel:
    """A tiny model in eval mode whose sparse time path holds seeded random weights (share 0.5)."""
    config = ModelConfig(vocab_size=int(label_ids.max()) + 2, hidden_size=16, num_heads=2, intermediate_size=16)
    config.sparse_time = True
    model = BehrtForMultiLabel(config, len(label_ids), label_token_ids=label_ids.tolist()).eval()
    assert model.sparse_time is not None
    generator = torch.Generator().manual_seed(seed)
    shapes = (model.sparse_time.own_weight.shape, model.sparse_time.shared_weight.shape, (len(label_ids),))
    model.sparse_time.load_fit(*(torch.randn(shape, generator=generator) for shape in shapes))
    return model


def test_model_logit_is_the_mean_of_the_deep_part_and_the_path_and_training_reads_the_deep_part(tmp_path):
    seqs, samples, label_ids, _ = _cohort(tmp_path, n_patients=10, seed=2)
    model = _model_with_random_path(label_ids, seed=0)
    assert model.sparse_time is not None
    _, _, batch, _ = _path_features(seqs, samples, label_ids)
    inputs = model_inputs(batch) | {"score_at": batch["score_at"]}
    with torch.no_grad():
        deep, path, both = model.deep_logits(**inputs), model.sparse_time(**_path_args(batch)), model(**inputs)
    torch.testing.assert_close(both, (deep + path) / 2)  # share 0.5 until finetune chooses one
    assert not torch.allclose(deep, path)
    model.sparse_time.set_share(0.75)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs), 0.25 * deep + 0.75 * path)
    with pytest.raises(ValueError, match=r"share must lie in \[0, 1\], got 1.5"):
        model.sparse_time.set_share(1.5)


def test_scoring_several_parts_in_one_pass_equals_scoring_each_and_runs_the_encoder_once(tmp_path):
    seqs, samples, label_ids, _ = _cohort(tmp_path, n_patients=12, seed=3)
    model = _model_with_random_path(label_ids, seed=1)
    assert model.sparse_time is not None
    model.sparse_time.set_share(0.6)
    passes = []
    model.encoder.register_forward_hook(lambda *_: passes.append(1))
    both = score_parts(model, seqs, samples.rows, samples.cuts, batch_size=64, parts=("model", "deep", "path"))
    assert len(passes) == 1  # 12 patients in one batch: one encoder pass for all three parts
    for part in ("model", "deep", "path"):
        alone = score(model, seqs, samples.rows, samples.cuts, batch_size=64, part=part)
        np.testing.assert_allclose(both[part], alone, rtol=1e-6, atol=1e-7)
    assert not np.allclose(both["model"], both["deep"])
    with pytest.raises(ValueError, match="part must be one of"):
        score_parts(model, seqs, parts=("wide",))  # type: ignore[arg-type]


def _distilling_task(tmp_path, weight: float, sparse_time: bool = True):
    """A tiny task whose path is fitted (when there is one), and one training batch of the cohort."""
    seqs, samples, label_ids, label_of_token = _cohort(tmp_path, n_patients=60, seed=2)
    config = ModelConfig(vocab_size=int(label_ids.max()) + 2, hidden_size=16, num_heads=2, intermediate_size=16)
    config.sparse_time = sparse_time
    task = MultiLabelTask(
        config, TrainerConfig(), len(label_ids), label_token_ids=label_ids.tolist(), path_distillation=weight
    )
    y = targets(seqs, samples, label_of_token)
    if sparse_time:
        fit_path(task.model, seqs, samples, label_of_token, y, 1.0, False)
    dataset, collate = labelled_dataset(seqs, samples.rows, samples.cuts, samples.label_spans, label_of_token, "visit")
    return task, collate([dataset[i] for i in range(len(dataset))])


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_path_distillation_trains_the_deep_part_towards_the_paths_probabilities(tmp_path):
    task, batch = _distilling_task(tmp_path, 0.25)
    task.train(False)  # no dropout: the same logits in both passes
    torch.manual_seed(0)
    for weight in task.model.parameters():  # a deep part that says something (fresh votes start at zero)
        weight.data.normal_(0.0, 0.3)
    with torch.no_grad():
        deep = task.model.deep_logits(**model_inputs(batch), score_at=batch["score_at"])
        path = task.model.path_logits(**_path_args(batch))
        loss = task.training_step(batch, 0)
    assert path.abs().max() > 0.1  # the fitted path is not silent, so the two terms differ
    labels = torch.nn.functional.binary_cross_entropy_with_logits(deep, batch["targets"].float())
    soft = torch.nn.functional.binary_cross_entropy_with_logits(deep, torch.sigmoid(path))
    assert float(loss) == pytest.approx(float(0.75 * labels + 0.25 * soft), rel=1e-5)
    assert abs(float(soft) - float(labels)) > 1e-3  # far above the tolerance above: the weights are checked


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_path_distillation_is_off_without_a_path_and_checked(tmp_path):
    task, batch = _distilling_task(tmp_path, 0.5, sparse_time=False)
    assert task.path_distillation == 0.0  # nothing to distil: the labels alone
    task.train(False)
    with torch.no_grad():
        deep = task.model.deep_logits(**model_inputs(batch), score_at=batch["score_at"])
        loss = task.training_step(batch, 0)
    assert float(loss) == pytest.approx(float(multilabel_loss(deep, batch["targets"])), rel=1e-6)
    with pytest.raises(ValueError, match=r"path_distillation must lie in \[0, 1\], got 1.5"):
        MultiLabelTask(
            ModelConfig(vocab_size=12, hidden_size=16, num_heads=2), TrainerConfig(), 3, path_distillation=1.5
        )
