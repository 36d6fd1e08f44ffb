"""The chains' generative start: a hidden Markov model of their own codes' record, fitted by maximum likelihood."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.schema import CLS_ID, N_SPECIAL, PAD_ID, SEP_ID
from behrt_rope.training.state_path_prefit import emitted_codes, prefit_chains

A, B, C = N_SPECIAL, N_SPECIAL + 1, N_SPECIAL + 2
VOCAB = N_SPECIAL + 3


class _Histories(torch.utils.data.Dataset):
    """Token streams as the fine-tuning datasets give them (what :func:`prefit_chains` reads of a split)."""

    def __init__(self, rows: list[tuple[list[int], list[int], list[float]]]) -> None:
        self.rows = rows
        self.lengths = np.array([len(r[0]) for r in rows])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[list[int], list[int], list[float]]:
        return self.rows[i]


def _collate(items: list[tuple[list[int], list[int], list[float]]]) -> dict[str, torch.Tensor]:
    width = max(len(i[0]) for i in items)

    def pad(values: list, fill: float) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    ids = pad([i[0] for i in items], PAD_ID)
    return {"token_ids": ids, "visit_index": pad([i[1] for i in items], 0), "ages": pad([i[2] for i in items], 0.0)}


class _Split:
    def __init__(self, rows: list) -> None:
        self.dataset, self.collate = _Histories(rows), _collate


def _hidden_onset_histories(patients: int = 400, seed: int = 0) -> list:
    """A state that turns on between visits (15% a visit, half a year apart) and stays on; while on a visit
    records A with chance 0.3 and B with 0.6, while off neither; C is noise at 20% whatever the state."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(patients):
        on, ids, visit, ages, age = False, [CLS_ID], [0], [40.0], 40.0
        for t in range(6):
            on = on or rng.random() < 0.15
            codes = [c for c, p in ((A, 0.3 * on), (B, 0.6 * on), (C, 0.2)) if rng.random() < p]
            ids += [*codes, SEP_ID]
            visit += [t] * (len(codes) + 1)
            ages += [age] * (len(codes) + 1)
            age += 0.5
        rows.append((ids, visit, ages))
    return rows


def test_each_chain_emits_the_codes_of_the_labels_that_read_it():
    f = HiddenStateFilter(VOCAB, num_labels=4, num_states=2)
    f.share_chains(torch.tensor([0, 1, 0, 3]))  # labels 0 and 2 share a chain
    codes = emitted_codes(f, torch.tensor([A, B, C, -1]))  # label 3 has no code
    assert codes.tolist() == [[A, C], [B, -1], [-1, -1]]


def test_a_chain_s_own_code_evidence_reads_back_as_the_hidden_markov_model_it_adopted():
    f = HiddenStateFilter(VOCAB, num_labels=3, num_states=2)
    f.share_chains(torch.tensor([0, 1, 0]))  # labels of A and C share a chain; B alone (a free slot)
    labels = torch.tensor([A, B, C])
    codes = emitted_codes(f, labels)
    log_odds = torch.tensor([[[-1.0, 0.5], [-2.0, 1.5]], [[0.3, -0.7], [9.0, 9.0]]])  # (2 chains, 2 slots, 2 states)
    f.adopt_emissions(codes, log_odds, labels)
    read = f.own_code_log_odds(codes)
    slot = codes >= 0
    assert torch.equal(read[slot], log_odds[slot])
    with torch.no_grad():  # the fit moves the evidence: the reading follows it
        f.evidence.view(VOCAB, 2, 2)[A, 0] += 1.0
    assert torch.equal(f.own_code_log_odds(codes)[0, 0], log_odds[0, 0] + 1.0)


def test_the_start_finds_the_hidden_state_and_the_chances_it_records_codes_with():
    torch.manual_seed(0)
    split = _Split(_hidden_onset_histories())
    f = HiddenStateFilter(VOCAB, num_labels=2, num_states=2)
    f.share_chains(torch.tensor([0, 0]))  # the labels of codes A and B read one chain
    labels = torch.tensor([A, B])
    batch = _collate(split.dataset.rows)
    codes = emitted_codes(f, labels)
    at_start = torch.full((1, 2, 2), -3.0)
    before, visits = f.code_log_likelihood(batch["token_ids"], batch["visit_index"], batch["ages"], codes, at_start)
    # from a ladder of levels (the default flat start stalls on this toy in a state per code on two seeds of three)
    report = prefit_chains(f, labels, split, max_epochs=60, start_log_odds=(-5.0, 0.0))  # type: ignore[arg-type]
    assert 0 < report["epochs"] <= 60 and report["nll_per_visit"] < -float(before.detach()) / float(visits)
    # the chances each state records A and B with, read off the adopted evidence (its log-odds)
    chances = torch.sigmoid(f.evidence.detach().view(VOCAB, 1, 2)[[A, B], 0])  # (2 codes, 2 states)
    on = int(chances[1].argmax())
    np.testing.assert_allclose(chances[:, on].numpy(), [0.3, 0.6], atol=0.08)
    assert (chances[:, 1 - on] < 0.05).all()
    assert f.evidence.detach().view(VOCAB, 1, 2)[C].abs().max() < 0.05  # noise keeps its small random start
    # filtered: A just recorded makes B several times likelier than at a first visit that recorded nothing, and
    # A recorded three empty visits ago still lifts it above a record that never showed either
    probe = torch.tensor(
        [[CLS_ID, A, SEP_ID, SEP_ID, SEP_ID, SEP_ID], [CLS_ID, SEP_ID, SEP_ID, SEP_ID, SEP_ID, PAD_ID]]
    )
    visit = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 0]])
    chance_b = torch.sigmoid(f(probe, visit, 40.0 + 0.5 * visit.float(), probe == SEP_ID))[:, 1]
    assert chance_b[0] > 4 * chance_b[4] and chance_b[3] > chance_b[7] and chance_b[7] < 0.1, chance_b


def test_a_start_that_the_budget_leaves_no_time_for_changes_nothing(caplog: pytest.LogCaptureFixture):
    split = _Split(_hidden_onset_histories(patients=20))
    f = HiddenStateFilter(VOCAB, num_labels=2, num_states=2)
    weights = {k: v.clone() for k, v in f.state_dict().items()}
    name = "state path set 1's chains"
    with caplog.at_level(logging.INFO, logger="behrt_rope"):
        report = prefit_chains(f, torch.tensor([A, B]), split, deadline=time.monotonic() - 1.0, name=name)  # type: ignore[arg-type]
    assert report["epochs"] == 0 and report["nll_per_visit"] is None and "budget" in report["stopped_by"]
    assert all(torch.equal(v, f.state_dict()[k]) for k, v in weights.items())
    assert f"{name} start at random: the time budget" in caplog.text  # the log says which set got no start


@pytest.mark.parametrize("epochs", [1, 3])
def test_the_start_runs_at_most_its_epochs(epochs: int):
    split = _Split(_hidden_onset_histories(patients=20))
    f = HiddenStateFilter(VOCAB, num_labels=2, num_states=2)
    report = prefit_chains(f, torch.tensor([A, B]), split, max_epochs=epochs)  # type: ignore[arg-type]
    assert 1 <= report["epochs"] <= epochs
