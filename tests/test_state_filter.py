"""The hidden-state filter: a learned continuous-time chain per label, filtered over the visits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.linalg import expm

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.schema import CLS_ID, N_SPECIAL, PAD_ID, SEP_ID

A, B = N_SPECIAL, N_SPECIAL + 1
V = N_SPECIAL + 3


def _stream():
    """Two patients. Row 0: visit 0 (age 50.0) records A and B (B twice), visit 1 (50.5) A, visit 2 (53.7) B;
    row 1 (female): one visit at 30.0 recording B, then padding."""
    ids = torch.tensor(
        [
            [CLS_ID, A, B, B, SEP_ID, A, SEP_ID, B, SEP_ID],
            [CLS_ID, B, SEP_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],
        ]
    )
    visit = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    ages = torch.tensor([[50.0] * 5 + [50.5, 50.5, 53.7, 53.7], [30.0] * 3 + [0.0] * 6])
    sex = torch.tensor([[2] * 9, [1] * 9])
    return ids, visit, ages, ids == SEP_ID, sex


def _filter(states=3, seed=0):
    torch.manual_seed(seed)
    f = HiddenStateFilter(V, num_labels=2, num_states=states)
    with torch.no_grad():  # away from the initial values, so every term matters
        for p in f.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return f


def _grid_transition(g, label, K, age, gap, female):
    """The transition matrix over ``gap`` years from ``age``: exact matrix exponentials at the four
    surrounding grid points (ages every 10 years; gaps 0 and 2^j / 64 years), mixed bilinearly in age and in
    the gap's grid position."""

    def exact(grid_age, grid_gap):
        a = (grid_age - 50) / 20
        x = g["rate"][label] + g["rate_age"][label] * a + g["rate_sex"][label] * female
        q = np.zeros((K, K))
        q[~np.eye(K, dtype=bool)] = np.log1p(np.exp(x))  # row-major off-diagonal order
        return expm((q - np.diag(q.sum(1))) * grid_gap)

    position = gap * 64 if gap < 1 / 64 else 1 + np.log2(gap * 64)
    u0, wu = int(np.floor(position)), position - np.floor(position)
    a0, wa = int(age // 10), (age % 10) / 10

    def gap_at(u):
        return 0.0 if u == 0 else 2.0 ** (u - 1) / 64

    def at_age(grid_age):
        return (1 - wu) * exact(grid_age, gap_at(u0)) + wu * exact(grid_age, gap_at(u0 + 1))

    return (1 - wa) * at_age(10 * a0) + wa * at_age(10 * (a0 + 1))


def _first_law(g, chain, age, female, male):
    """Chain ``chain``'s state distribution at a first visit at ``age``, written out (``g``: the parameters)."""
    a = (age - 50) / 20
    prior = g["prior"][chain] @ np.array([1, a, a * a, female, male])
    state = np.exp(prior - prior.max())
    return state / state.sum()


def _reference(f, visits, ages, female, male):
    """The filter written out with scipy for one patient: ``visits`` lists each visit's distinct codes."""
    g = {n: p.detach().double().numpy() for n, p in f.named_parameters()}
    K, out = f.num_states, []
    for label in range(f.num_labels):
        state, chances = _first_law(g, label, ages[0], female, male), []
        for t, codes in enumerate(visits):
            if t > 0:
                state = state @ _grid_transition(g, label, K, ages[t - 1], ages[t] - ages[t - 1], female)
            potential = g["visit_evidence"][label].copy()
            for c in codes:
                potential += g["evidence"][c].reshape(f.num_labels, K)[label]
            state = state * np.exp(potential)
            state /= state.sum()
            p = (state / (1 + np.exp(-g["emission"][label]))).sum()
            chances.append(np.log(p / (1 - p)))
        out.append(chances)
    return np.array(out).T  # (visits, labels)


def test_logits_equal_the_written_out_filter():
    ids, visit, ages, score_at, sex = _stream()
    f = _filter()
    logits = f(ids, visit, ages, score_at, sex)  # (4 scored visits, 2 labels)
    assert logits.shape == (4, 2) and logits.dtype == torch.float32
    expected0 = _reference(f, [{A, B}, {A}, {B}], [50.0, 50.5, 53.7], female=0, male=1)
    expected1 = _reference(f, [{B}], [30.0], female=1, male=0)
    np.testing.assert_allclose(logits[:3].detach().numpy(), expected0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[3:].detach().numpy(), expected1, rtol=1e-4, atol=1e-4)


def _hmm_reference(f, visits, ages, female, male, log_odds):
    """Each chain ``g`` of ``f`` as a hidden Markov model of code ``(A, B)[g]`` written out with scipy, for one
    patient: the log-likelihood of whether each visit records the chain's code, and each visit's filtered chance
    of recording it (``(visits, labels)``)."""
    g = {n: p.detach().double().numpy() for n, p in f.named_parameters()}
    K, total, out = f.num_states, 0.0, []
    chance_in = 1 / (1 + np.exp(-log_odds.double().numpy()[:, 0]))  # (G, K)
    for chain, code in enumerate((A, B)):
        state, chances = _first_law(g, chain, ages[0], female, male), []
        for t, codes in enumerate(visits):
            if t > 0:
                state = state @ _grid_transition(g, chain, K, ages[t - 1], ages[t] - ages[t - 1], female)
            likelihood = chance_in[chain] if code in codes else 1 - chance_in[chain]
            total += np.log((state * likelihood).sum())
            state = state * likelihood / (state * likelihood).sum()
            chances.append((state * chance_in[chain]).sum())
        out.append(chances)
    return total, np.array(out).T


def test_the_chains_as_hidden_markov_models_score_and_filter_as_written_out():
    ids, visit, ages, score_at, sex = _stream()
    f = _filter(states=3)
    codes = torch.tensor([[A], [B]])
    log_odds = torch.randn(2, 1, 3)
    loglik, visits = f.code_log_likelihood(ids, visit, ages, codes, log_odds, sex)
    total0, chances0 = _hmm_reference(f, [{A, B}, {A}, {B}], [50.0, 50.5, 53.7], 0, 1, log_odds)
    total1, chances1 = _hmm_reference(f, [{B}], [30.0], 1, 0, log_odds)
    assert int(visits) == 4
    assert float(loglik.detach()) == pytest.approx(total0 + total1, rel=1e-4)
    # adopted (other codes' evidence zero), the filter's update is that model's and each label starts at its code's
    # chance at this visit
    with torch.no_grad():
        f.evidence.zero_()
    f.adopt_emissions(codes, log_odds, torch.tensor([A, B]))
    chances = torch.sigmoid(f(ids, visit, ages, score_at, sex)).detach().numpy()
    np.testing.assert_allclose(chances, np.concatenate([chances0, chances1]), rtol=1e-4, atol=1e-6)


def test_a_shared_chain_emits_both_codes_and_a_free_slot_nothing():
    ids, visit, ages, _, sex = _stream()
    f = _filter(states=3)
    f.share_chains(torch.tensor([0, 0]))  # both labels read chain 0
    log_odds = torch.randn(1, 2, 3)
    both, _ = f.code_log_likelihood(ids, visit, ages, torch.tensor([[A, B]]), log_odds, sex)
    free, _ = f.code_log_likelihood(ids, visit, ages, torch.tensor([[A, -1]]), log_odds, sex)
    alone, _ = f.code_log_likelihood(ids, visit, ages, torch.tensor([[A]]), log_odds[:, :1], sex)
    assert float(free.detach()) == pytest.approx(float(alone.detach()), rel=1e-6)
    assert float(both.detach()) < float(alone.detach())
    with pytest.raises(ValueError, match="do not fit the filter"):
        f.adopt_emissions(torch.tensor([[A, B]]), torch.randn(2, 2, 3), torch.tensor([A, B]))


def test_transition_matrices_are_stochastic_and_exact_on_the_grid():
    f = _filter(states=4)
    q = f.generator(torch.tensor([20.0, 80.0]), torch.tensor([1.0, 0.0]))  # (2, L, K, K)
    assert torch.allclose(q.sum(-1), torch.zeros(2, 2, 4), atol=1e-5)
    table = f.transition_table()  # (sex, age, gap, L, K, K)
    assert (table >= -1e-6).all() and torch.allclose(table.sum(-1), torch.ones_like(table.sum(-1)), atol=1e-4)
    # squaring is exact: the grid's 2^j / 64 years equal the matrix exponential there (female, age 20)
    for j in (0, 5, 9):
        direct = torch.linalg.matrix_exp(q[0] * 2.0**j / 64)
        assert torch.allclose(table[1, 2, j + 1], direct, atol=1e-4)
    assert torch.equal(table[:, :, 0], torch.eye(4).expand_as(table[:, :, 0]))


def test_a_chain_with_a_reach_moves_only_between_states_that_near():
    torch.manual_seed(0)
    f = HiddenStateFilter(V, num_labels=2, num_states=5, reach=1)
    assert f.rate.shape == (2, 2 * (5 - 1))  # a rate for each move between neighbours, none for the others
    q = f.generator(torch.tensor([20.0, 80.0]), torch.tensor([1.0, 0.0]))  # (2, L, K, K)
    apart = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs()
    assert (q[..., apart > 1] == 0).all() and (q[..., apart == 1] > 0).all()
    assert torch.allclose(q.sum(-1), torch.zeros(2, 2, 5), atol=1e-5)
    table = f.transition_table()  # far states are reached over longer gaps, through the ones between
    assert torch.allclose(table.sum(-1), torch.ones_like(table.sum(-1)), atol=1e-4)
    assert table[0, 5, 1, 0, 0, 4] < 1e-6 < table[0, 5, -1, 0, 0, 4]
    assert HiddenStateFilter(V, 2, 5, reach=2).rate.shape == (2, 14)
    assert HiddenStateFilter(V, 2, 5, reach=4).rate.shape == HiddenStateFilter(V, 2, 5).rate.shape == (2, 20)
    with pytest.raises(ValueError, match="reach"):
        HiddenStateFilter(V, 2, 5, reach=-1)


def test_a_visit_sees_only_its_own_and_earlier_visits():
    ids, visit, ages, score_at, sex = _stream()
    f = _filter()
    before = f(ids, visit, ages, score_at, sex)
    changed = ids.clone()
    changed[0, 7] = A  # visit 2 now records A instead of B
    after = f(changed, visit, ages, score_at, sex)
    assert torch.equal(before[:2], after[:2]) and not torch.allclose(before[2], after[2])


def test_a_patient_scores_the_same_alone_and_beside_a_longer_one():
    ids, visit, ages, score_at, sex = _stream()
    f = _filter()
    together = f(ids, visit, ages, score_at, sex)
    alone = f(ids[1:, :3], visit[1:, :3], ages[1:, :3], score_at[1:, :3], sex[1:, :3])
    assert torch.allclose(together[3:], alone, atol=1e-6)


def test_the_filter_learns_a_hidden_onset_that_counts_alone_miss():
    """A state that turns on and stays on shows through code A now and then; label B is likely only while on.
    After training, a patient whose A was recorded long ago still scores high for B, one never recorded low."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(300):
        on, ids, visit, ages, age = False, [CLS_ID], [0], [40.0], 40.0
        for t in range(6):
            on = on or rng.random() < 0.15
            codes = [A] if on and rng.random() < 0.3 else []
            codes += [B] if on and rng.random() < 0.6 else []
            ids += [*codes, SEP_ID]
            visit += [t] * (len(codes) + 1)
            ages += [age] * (len(codes) + 1)
            age += 0.5
        rows.append((ids, visit, ages))
    width = max(len(r[0]) for r in rows)

    def pad(values, fill):
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    ids = pad([r[0] for r in rows], PAD_ID)
    visit, ages = pad([r[1] for r in rows], 0), pad([r[2] for r in rows], 0.0)
    score_at = ids == SEP_ID
    target = torch.zeros(int(score_at.sum()), 2)
    # label 1 (code B) at the next visit; the last visit of each patient is not scored in the loss
    positions = score_at.nonzero()
    has_next = torch.zeros(len(positions), dtype=torch.bool)
    for n, (r, c) in enumerate(positions.tolist()):
        nxt = [i for i in range(c + 1, width) if ids[r, i] == SEP_ID]
        if nxt:
            has_next[n] = True
            start = c + 1
            target[n, 1] = float((ids[r, start : nxt[0]] == B).any())
    f = HiddenStateFilter(V, num_labels=2, num_states=2)
    opt = torch.optim.Adam(f.parameters(), lr=0.05)
    for _ in range(150):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            f(ids, visit, ages, score_at)[has_next, 1], target[has_next, 1]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    probe = torch.tensor(
        [[CLS_ID, A, SEP_ID, SEP_ID, SEP_ID, SEP_ID], [CLS_ID, SEP_ID, SEP_ID, SEP_ID, SEP_ID, PAD_ID]]
    )
    probe_visit = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 0]])
    probe_ages = 40.0 + 0.5 * probe_visit.float()
    chance = torch.sigmoid(f(probe, probe_visit, probe_ages, probe == SEP_ID))[:, 1]
    seen_long_ago, never = chance[3].item(), chance[7].item()  # both at their fourth visit
    assert seen_long_ago > 0.35 and never < 0.25, (seen_long_ago, never)


def test_the_head_adds_the_filter_to_the_deep_part_and_rejects_one_state():
    cfg = ModelConfig(vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, age_heads=0)
    ids, visit, ages, score_at, sex = _stream()
    segments = torch.zeros_like(ids)
    torch.manual_seed(0)
    plain = BehrtForMultiLabel(cfg, num_labels=2, label_token_ids=[A, B]).eval()
    torch.manual_seed(0)
    with_filter = BehrtForMultiLabel(
        ModelConfig(**{**cfg.__dict__, "state_filter": 3}), num_labels=2, label_token_ids=[A, B]
    ).eval()
    args = (ids, ages, segments, visit, None, score_at, sex)
    added = with_filter.state_filter(ids, visit, ages, score_at, sex)
    assert torch.allclose(with_filter.deep_logits(*args), plain.deep_logits(*args) + added, atol=1e-5)
    with pytest.raises(ValueError, match="state_filter"):
        ModelConfig(vocab_size=V, state_filter=1)


def test_a_fine_tuned_model_carries_its_filter_through_the_bundle(tmp_path):
    from behrt_rope import schema as S
    from behrt_rope.data.sequences import load_tokens
    from behrt_rope.training.bundle import load_bundle
    from behrt_rope.training.inference import multilabel_model, score_parts
    from tests.fixtures_training import build_finetuned

    _, model_dir = build_finetuned(tmp_path, 120, 7, "model.state_filter=3")
    bundle = load_bundle(model_dir, "multilabel")
    assert bundle["model_config"].state_filter == 3
    model = multilabel_model(bundle)
    assert model.state_filter is not None and model.state_filter.num_states == 3
    seqs = load_tokens(tmp_path / "etl").split(S.TUNING)
    deep = score_parts(model, seqs, parts=("deep",))["deep"]
    assert np.isfinite(deep).all() and ((deep > 0) & (deep < 1)).all()
    with torch.no_grad():  # every state's chance 0.5: the filter adds logit 0, and the deep part changes
        model.state_filter.emission.fill_(0.0)
    assert not np.allclose(score_parts(model, seqs, parts=("deep",))["deep"], deep)
