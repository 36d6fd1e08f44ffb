"""Label codes that travel together share one hidden-state chain in the state path."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from behrt_rope.data.sequences import Sequences
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.model.state_path import StatePath
from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID
from behrt_rope.training.chain_pairs import paired_chains, presence_correlation

A, B, C, D = (N_SPECIAL + i for i in range(4))
VOCAB = N_SPECIAL + 6


def _sequences(histories: list[list[int]]) -> Sequences:
    """One visit per patient holding ``codes`` (in any order), ``[CLS] codes [SEP]``."""
    streams = [np.array([CLS_ID, *codes, SEP_ID], dtype=np.int64) for codes in histories]
    flat = np.concatenate(streams)
    zeros = np.zeros(len(flat), dtype=np.int64)
    return Sequences(
        patients=pd.DataFrame(index=range(len(streams))),
        offsets=np.concatenate([[0], np.cumsum([len(s) for s in streams])]).astype(np.int64),
        token_ids=flat,
        ages=np.full(len(flat), 50.0, dtype=np.float32),
        segments=zeros,
        visit_index=zeros,
        visit_days=zeros,
    )


def _cohort(seed: int = 0, patients: int = 400) -> tuple[Sequences, np.ndarray]:
    """A and B travel together (B recorded with A 90% of the time, twice per record for some); C and D are
    independent of everything; returns the sequences and the presence matrix (patients, 4) of A, B, C, D."""
    rng = np.random.default_rng(seed)
    present = np.zeros((patients, 4), dtype=bool)
    present[:, 0] = rng.random(patients) < 0.3
    present[:, 1] = np.where(present[:, 0], rng.random(patients) < 0.9, rng.random(patients) < 0.05)
    present[:, 2:] = rng.random((patients, 2)) < 0.4
    histories = [
        [code for code, here in zip((A, B, B, C, D), row[[0, 1, 1, 2, 3]], strict=True) if here] for row in present
    ]
    return _sequences(histories), present


def test_presence_correlation_is_pearson_s_on_the_0_1_columns():
    seqs, present = _cohort()
    labels = np.array([A, B, C, D, -1])  # a label without a code: no correlation
    correlation = presence_correlation(seqs, labels)
    expected = np.corrcoef(present.T.astype(float))
    np.fill_diagonal(expected, 0.0)
    np.testing.assert_allclose(correlation[:4, :4], expected, atol=1e-12)
    assert (correlation[4] == 0).all() and (correlation[:, 4] == 0).all()


def test_codes_that_travel_together_share_a_chain_and_others_keep_their_own():
    seqs, present = _cohort()
    labels = np.array([C, B, D, A])  # label order need not follow the codes'
    assert paired_chains(seqs, labels).tolist() == [0, 1, 2, 1]  # A reads B's chain (label 1, the lower)
    together = np.corrcoef(present[:, 0], present[:, 1])[0, 1]
    assert paired_chains(seqs, labels, min_correlation=together + 0.01).tolist() == [0, 1, 2, 3]
    assert paired_chains(seqs, np.array([A])).tolist() == [0]


def _filter_pair() -> HiddenStateFilter:
    torch.manual_seed(0)
    f = HiddenStateFilter(VOCAB, num_labels=2, num_states=3)
    with torch.no_grad():
        for p in f.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return f


def _stream() -> tuple[torch.Tensor, ...]:
    ids = torch.tensor([[CLS_ID, A, SEP_ID, B, C, SEP_ID, A, SEP_ID]])
    visit = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]])
    ages = torch.tensor([[40.0, 40.0, 40.0, 41.5, 41.5, 41.5, 45.0, 45.0]])
    return ids, visit, ages, ids == SEP_ID, torch.full_like(ids, 2)


def test_a_label_on_a_shared_chain_reads_that_chain_s_states_with_its_own_emission():
    f = _filter_pair()
    where = _stream()
    shared = _filter_pair()
    shared.share_chains(torch.tensor([0, 0]))
    copied = _filter_pair()  # label 1's chain made a copy of label 0's, its emission kept
    K = copied.num_states
    with torch.no_grad():
        for name in ("rate", "rate_age", "rate_sex", "prior", "visit_evidence"):
            getattr(copied, name)[1] = getattr(copied, name)[0]
        evidence = copied.evidence.view(VOCAB, 2, K)
        evidence[:, 1] = evidence[:, 0]
        out, expected, own = shared(*where), copied(*where), f(*where)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out[:, 0], own[:, 0])  # label 0 reads its own chain as before
    assert not torch.allclose(out[:, 1], own[:, 1])
    with pytest.raises(ValueError, match="chain_of_label"):
        shared.share_chains(torch.tensor([0, 2]))  # no label 2


def test_chains_no_label_reads_are_dropped_and_the_rest_keep_their_parameters():
    torch.manual_seed(0)
    f = HiddenStateFilter(VOCAB, num_labels=3, num_states=3)
    before = {name: p.detach().clone() for name, p in f.named_parameters()}
    where = _stream()
    f.share_chains(torch.tensor([0, 2, 2]))  # labels 1 and 2 read label 2's chain: chain 1 is read by none
    assert f.num_chains == 2 and f.chain_of_label.tolist() == [0, 1, 1]
    for name in ("rate", "rate_age", "rate_sex", "prior", "visit_evidence"):
        torch.testing.assert_close(getattr(f, name), before[name][[0, 2]])
    torch.testing.assert_close(f.evidence, before["evidence"].view(VOCAB, 3, 3)[:, [0, 2]].reshape(VOCAB, 6))
    torch.testing.assert_close(f.emission, before["emission"])  # per label, untouched
    f.share_chains(torch.tensor([0, 1, 2]))  # each label reads the chain it reads now: nothing changes
    assert f.num_chains == 2 and f.chain_of_label.tolist() == [0, 1, 1]
    f.share_chains(torch.tensor([0, 0, 0]))  # every label reads label 0's chain
    assert f.num_chains == 1 and f.chain_of_label.tolist() == [0, 0, 0]
    torch.testing.assert_close(f.rate, before["rate"][[0]])
    loaded = HiddenStateFilter(VOCAB, num_labels=3, num_states=3)  # as a bundle is: built per label, then loaded
    loaded.load_state_dict(f.state_dict())
    assert loaded.num_chains == 1
    torch.testing.assert_close(loaded(*where), f(*where))


def test_a_filter_saved_before_shared_chains_loads_with_each_label_on_its_own():
    f = _filter_pair()
    f.share_chains(torch.tensor([0, 0]))
    old = {k: v for k, v in f.state_dict().items() if k != "chain_of_label"}
    loaded = HiddenStateFilter(VOCAB, num_labels=2, num_states=3)
    loaded.load_state_dict(old)
    assert loaded.chain_of_label.tolist() == [0, 1]


def test_a_shared_chain_reads_both_labels_codes_free_of_the_penalty():
    path = StatePath(VOCAB, num_labels=2, num_states=3, label_token_ids=[A, B])
    with torch.no_grad():
        view = path.chains[0].evidence.view(VOCAB, 2, 3)
        view.zero_()
        view[A, 0], view[B, 0] = 2.0, -1.0  # both codes on chain 0
        view[C, 0, 0] = 0.5  # a code of neither label
    assert path.cross_evidence_l1().item() == pytest.approx((3 * 1.0 + 0.5) / 2)  # B is not chain 0's own yet
    path.share_chains(torch.tensor([0, 0]))
    assert path.cross_evidence_l1().item() == pytest.approx(0.5 / 2)
