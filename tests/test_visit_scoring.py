"""Visit pooling: one visit-causal pass per patient scores every prediction time, exactly as if each
sample's input had been cut at its prediction time, in the caller's sample order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.data.batching import pad_batch
from behrt_rope.data.datasets import LabelledDataset, VisitScoredDataset, collate_visit_scored
from behrt_rope.data.labels import TaskConfig, build_samples, label_index
from behrt_rope.data.sequences import Sequences
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.inference import score

VOCAB = 12


def _sequences(visits_per_patient: list[list[list[int]]]) -> Sequences:
    """Patients given as lists of visits (lists of code ids), 60 days apart, all born on 1970-01-01."""
    import pandas as pd

    ids, ages, segs, vidx, days, lengths = [], [], [], [], [], []
    for visits in visits_per_patient:
        stream = [(S.CLS_ID, 0)]
        for k, codes in enumerate(visits):
            stream += [(c, k) for c in codes] + [(S.SEP_ID, k)]
        for token, k in stream:
            ids.append(token), vidx.append(k), segs.append(k % 2), days.append(7300 + 60 * k)
            ages.append((7300 + 60 * k) / 365.25)
        lengths.append(len(stream))
    n = len(visits_per_patient)
    last = [np.datetime64("1970-01-01") + np.timedelta64(7300 + 60 * (len(v) - 1), "D") for v in visits_per_patient]
    patients = pd.DataFrame(
        {
            S.PATIENT_ID: [f"p{i}" for i in range(n)],
            S.SPLIT: ["train"] * n,
            S.LAST_EVENT_TIME: np.array(last, dtype="datetime64[us]"),
        }
    )
    return Sequences(
        patients,
        np.concatenate([[0], np.cumsum(lengths)]),
        np.array(ids),
        np.array(ages, np.float32),
        np.array(segs),
        np.array(vidx),
        np.array(days),
    )


def _model(**options) -> BehrtForMultiLabel:
    """The default visit-pooled head, or with options (e.g. label attention), its zero-started readouts
    randomised so that every path carries signal a leak would show."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=32,
        dropout=0.0,
        time2vec_periodic=4,
        **options,
    )
    model = BehrtForMultiLabel(config, num_labels=3, pooling="visit").eval()
    if model.label_attention is not None:
        with torch.no_grad():
            for param in model.label_attention.parameters():
                param.normal_(0.0, 0.5)
    return model


HEADS = pytest.mark.parametrize(
    "options",
    [
        {},
        {"label_attention_heads": 2, "age_heads": 1, "label_attention_keys": "visit"},
        {"label_attention_heads": 2, "label_attention_keys": "token"},
        {"history_max": True},
    ],
    ids=["default", "visit_label_attention", "token_label_attention", "history_max"],
)


SEQS = _sequences([[[5, 6], [7], [5, 8, 9], [10]], [[11], [6, 7]], [[5], [5], [5], [9, 10, 11]]])


def _prefix_logits(model: BehrtForMultiLabel, row: int, cut: int) -> torch.Tensor:
    start = SEQS.offsets[row]
    item = {f: getattr(SEQS, f)[start : start + cut] for f in ("token_ids", "ages", "segments", "visit_index")}
    batch = pad_batch([item])
    score_at = torch.zeros_like(batch["attention_mask"])
    score_at[0, cut - 1] = True
    with torch.no_grad():
        return model(
            **{k: batch[k] for k in ("token_ids", "ages", "segments", "visit_index", "attention_mask")},
            score_at=score_at,
        )[0]


@HEADS
def test_one_pass_equals_cutting_the_input_at_each_prediction_time(options):
    model = _model(**options)
    samples = build_samples(SEQS, TaskConfig(name="next_visit"))
    dataset = VisitScoredDataset(SEQS, samples.rows, samples.cuts)
    batch = collate_visit_scored([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model(
            **{k: batch[k] for k in ("token_ids", "ages", "segments", "visit_index", "attention_mask")},
            score_at=batch["score_at"],
        )
    assert logits.shape == (len(samples), 3)
    for j, i in enumerate(dataset.sample_order):
        torch.testing.assert_close(
            logits[j], _prefix_logits(model, samples.rows[i], samples.cuts[i]), atol=1e-5, rtol=1e-5
        )


@HEADS
def test_later_visits_never_leak_into_earlier_predictions(options):
    model = _model(**options)
    changed = _sequences([[[5, 6], [7], [11, 11, 11], [9]], [[11], [6, 7]], [[5], [5], [5], [9, 10, 11]]])
    samples = build_samples(SEQS, TaskConfig(name="next_visit"))
    before = score(model, SEQS, samples.rows, samples.cuts)
    after = score(model, changed, samples.rows, samples.cuts)
    first_patient_early = (samples.rows == 0) & (samples.cuts <= 6)  # visits 0 and 1 of patient 0
    np.testing.assert_allclose(before[first_patient_early], after[first_patient_early], atol=1e-6)
    assert not np.allclose(
        before[(samples.rows == 0) & (samples.cuts > 6)], after[(samples.rows == 0) & (samples.cuts > 6)]
    )


def test_score_keeps_the_callers_sample_order_and_batching_does_not_matter():
    model = _model()
    samples = build_samples(SEQS, TaskConfig(name="next_visit"))
    shuffled = np.random.default_rng(0).permutation(len(samples))
    rows, cuts = samples.rows[shuffled], samples.cuts[shuffled]
    probs = score(model, SEQS, rows, cuts, batch_size=1)
    for j in range(len(rows)):
        expected = torch.sigmoid(_prefix_logits(model, rows[j], cuts[j])).numpy()
        np.testing.assert_allclose(probs[j], expected, atol=1e-5)
    np.testing.assert_allclose(score(model, SEQS, rows, cuts, batch_size=64), probs, atol=1e-6)


def test_visit_dataset_targets_match_the_per_sample_dataset():
    samples = build_samples(SEQS, TaskConfig(name="next_visit"))
    labels = label_index(np.array([5, 7, 9]), VOCAB)
    per_sample = LabelledDataset(SEQS, samples.rows, samples.cuts, samples.label_spans, labels)
    visits = VisitScoredDataset(SEQS, samples.rows, samples.cuts, samples.label_spans, labels)
    stacked = np.concatenate([visits[i]["target"] for i in range(len(visits))])
    expected = np.stack([per_sample[i]["target"] for i in visits.sample_order])
    np.testing.assert_array_equal(stacked, expected)
    assert stacked.sum() > 0
