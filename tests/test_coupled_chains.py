"""Coupled chains: the state path's chains drive each other's rates (``HiddenStateFilter(coupled=True)``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from behrt_rope.model.state_filter import HiddenStateFilter
from tests.test_state_filter import A, B, V, _grid_transition, _stream


def _coupled(labels=3, states=3, seed=0):
    torch.manual_seed(seed)
    f = HiddenStateFilter(V, num_labels=labels, num_states=states, coupled=True)
    with torch.no_grad():  # away from the initial values, so every term matters
        for p in f.parameters():
            p.add_(0.5 * torch.randn_like(p))
        f.drive.mul_(4.0)  # regimes far from one half
    return f


def _reference(f, visits, ages, female, male):
    """The coupled filter written out with scipy for one patient, every chain in one loop: between visits each
    chain moves by ``(1 - s) P + s P'``, ``s`` read from the other chains' states at the earlier visit."""
    g = {n: p.detach().double().numpy() for n, p in f.named_parameters()}
    shifted = {**g, "rate": g["rate"] + g["rate_shift"]}
    G, K = f.num_chains, f.num_states
    a = (ages[0] - 50) / 20
    prior = np.einsum("gkf,f->gk", g["prior"], np.array([1, a, a * a, female, male]))
    state = np.exp(prior - prior.max(1, keepdims=True))
    state /= state.sum(1, keepdims=True)
    out = []
    for t, codes in enumerate(visits):
        if t > 0:
            moved = np.empty_like(state)
            for chain in range(G):
                drive = sum(
                    g["drive"][other * K + k, chain] * state[other, k]
                    for other in range(G)
                    if other != chain
                    for k in range(K)
                )
                s = 1 / (1 + np.exp(-(g["drive_bias"][chain] + drive)))
                step = (ages[t - 1], ages[t] - ages[t - 1], female)
                move = (1 - s) * _grid_transition(g, chain, K, *step) + s * _grid_transition(shifted, chain, K, *step)
                moved[chain] = state[chain] @ move
            state = moved
        potential = g["visit_evidence"].copy()
        for c in codes:
            potential += g["evidence"][c].reshape(G, K)
        state = state * np.exp(potential)
        state /= state.sum(1, keepdims=True)
        chains = f.chain_of_label.numpy()
        p = (state[chains] / (1 + np.exp(-g["emission"]))).sum(1)
        out.append(np.log(p / (1 - p)))
    return np.array(out)  # (visits, labels)


def test_coupled_logits_equal_the_written_out_filter():
    ids, visit, ages, score_at, sex = _stream()
    f = _coupled()
    logits = f(ids, visit, ages, score_at, sex).detach().numpy()  # (4 scored visits, 3 labels)
    expected0 = _reference(f, [{A, B}, {A}, {B}], [50.0, 50.5, 53.7], female=0, male=1)
    expected1 = _reference(f, [{B}], [30.0], female=1, male=0)
    np.testing.assert_allclose(logits[:3], expected0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[3:], expected1, rtol=1e-4, atol=1e-4)
    assert not np.allclose(logits, _uncoupled_copy(f)(ids, visit, ages, score_at, sex).detach().numpy(), atol=1e-3)


def _uncoupled_copy(f: HiddenStateFilter) -> HiddenStateFilter:
    plain = HiddenStateFilter(V, f.num_labels, f.num_states)
    plain.load_state_dict({k: v for k, v in f.state_dict().items() if k not in ("rate_shift", "drive", "drive_bias")})
    return plain


def test_without_a_shift_it_is_the_uncoupled_filter_and_loads_one():
    ids, visit, ages, score_at, sex = _stream()
    f = _coupled()
    with torch.no_grad():
        f.rate_shift.zero_()
    plain = _uncoupled_copy(f)
    assert torch.allclose(f(ids, visit, ages, score_at, sex), plain(ids, visit, ages, score_at, sex), atol=1e-6)
    loaded = HiddenStateFilter(V, f.num_labels, f.num_states, coupled=True)
    loaded.load_state_dict(plain.state_dict())  # a filter saved uncoupled: no second rates, no drive
    assert torch.allclose(loaded(ids, visit, ages, score_at, sex), plain(ids, visit, ages, score_at, sex))
    assert not loaded.rate_shift.any() and not loaded.drive.any()


def test_a_chain_is_driven_by_the_others_only():
    ids, visit, ages, score_at, sex = _stream()
    f = _coupled()
    before = f(ids, visit, ages, score_at, sex)
    K = f.num_states
    with torch.no_grad():  # a chain's weights on its own states
        for chain in range(f.num_chains):
            f.drive[chain * K : (chain + 1) * K, chain] += 10.0
    assert torch.equal(f(ids, visit, ages, score_at, sex), before)
    with torch.no_grad():
        f.drive[0:K, 1] += 10.0  # chain 0 drives chain 1 harder: label 1 moves, label 0 does not
    after = f(ids, visit, ages, score_at, sex)
    assert torch.allclose(after[:, 0], before[:, 0], atol=1e-6) and not torch.allclose(after[:, 1], before[:, 1])


def test_shared_chains_keep_their_drive_between_the_chains_kept():
    ids, visit, ages, score_at, sex = _stream()
    f = _coupled(labels=3)
    K = f.num_states
    drive = f.drive.detach().clone().view(3, K, 3)
    f.share_chains(torch.tensor([0, 0, 2]))  # labels 0 and 1 read chain 0; chain 1 is dropped
    assert f.num_chains == 2 and f.rate_shift.shape[0] == 2 and f.drive_bias.shape == (2,)
    assert torch.equal(f.drive.view(2, K, 2), drive[[0, 2]][:, :, [0, 2]])
    logits = f(ids, visit, ages, score_at, sex).detach().numpy()
    expected = _reference(f, [{A, B}, {A}, {B}], [50.0, 50.5, 53.7], female=0, male=1)
    np.testing.assert_allclose(logits[:3], expected, rtol=1e-4, atol=1e-4)
    others = f.drive.detach().view(2, K, 2) * (1 - torch.eye(2))[:, None, :]
    assert f.drive_l1().item() == pytest.approx(others.abs().sum().item() / 3)
