"""Token-level label attention: silent at the start, and its scores really carry the time since a code was
recorded (direction and units), so a label can prefer recent records over old ones."""

from __future__ import annotations

import pytest
import torch

from behrt_rope.model import token_label_attention
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.token_label_attention import CHUNK_SCORES, KEY_SIZE, TokenLabelAttention
from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID

CODE, OTHER = N_SPECIAL, N_SPECIAL + 1
DAYS_PER_YEAR = 365.25


def _patient(code_days_before: float | None) -> dict[str, torch.Tensor]:
    """[CLS] v0 [SEP] v1 [SEP], scored at the second [SEP] (at age 50). Visit 0 holds CODE (if
    ``code_days_before`` is given, that many days before visit 1) and OTHER; visit 1 holds OTHER."""
    gap = code_days_before if code_days_before is not None else 100.0
    first = CODE if code_days_before is not None else OTHER
    ids = [CLS_ID, first, OTHER, SEP_ID, OTHER, SEP_ID]
    visits = [0, 0, 0, 0, 1, 1]
    ages = [50.0 - gap / DAYS_PER_YEAR] * 4 + [50.0] * 2
    return {
        "token_ids": torch.tensor([ids]),
        "visit_index": torch.tensor([visits]),
        "ages": torch.tensor([ages]),
        "score_at": torch.tensor([[False, False, False, False, False, True]]),
    }


def _hidden(token_ids: torch.Tensor, size: int) -> torch.Tensor:
    """Hidden states that say only "this is CODE" in dimension 0."""
    hidden = torch.zeros(*token_ids.shape, size)
    hidden[..., 0] = (token_ids == CODE).float()
    return hidden


def _attention(time_weight: float) -> TokenLabelAttention:
    """One head, one label: the query picks out CODE; its vote is 1 per CODE token; the time bias is
    ``time_weight`` x log(1 + days since the token)."""
    config = ModelConfig(
        label_code_tie=False,
        label_time_steps=False,  # GELU ramps, so that e[0] below is GELU(log(1 + days))
        vocab_size=10,
        hidden_size=KEY_SIZE,
        num_heads=2,
        label_attention_heads=1,
    )
    attention = TokenLabelAttention(config, num_labels=1)
    with torch.no_grad():
        for p in attention.parameters():
            p.zero_()
        attention.key.weight.copy_(torch.eye(KEY_SIZE))
        attention.query[0, 0, 0] = 40.0  # score 10 on a CODE token, 0 elsewhere
        attention.value.weight[0, 0] = 1.0  # vote 1 from a CODE token
        attention.elapsed[0].weight[0, 0] = 1.0  # e[0] = GELU(log(1 + days))
        attention.time_bias[0, 0, 0] = time_weight
    return attention.eval()


def _logit(attention: TokenLabelAttention, code_days_before: float | None) -> float:
    batch = _patient(code_days_before)
    hidden = _hidden(batch["token_ids"], KEY_SIZE)
    with torch.no_grad():
        return float(attention(hidden, batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"]))


def test_starts_silent():
    config = ModelConfig(label_code_tie=False, vocab_size=10, hidden_size=16, num_heads=2, label_attention_heads=2)
    attention = TokenLabelAttention(config, num_labels=3)
    batch = _patient(30.0)
    logits = attention(
        torch.randn(1, 6, 16), batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"]
    )
    assert logits.shape == (1, 3)
    assert torch.equal(logits, torch.zeros(1, 3))


def test_a_recorded_code_is_found_and_never_recorded_goes_to_the_sink():
    attention = _attention(time_weight=0.0)
    assert _logit(attention, 30.0) > 0.99  # nearly all weight on the one CODE token (vote 1)
    assert _logit(attention, None) == 0.0  # no CODE: weight on the sink and the OTHER tokens, votes 0


def test_time_since_the_record_enters_the_score_with_the_right_sign():
    neutral, prefers_recent = _attention(0.0), _attention(-3.0)
    assert abs(_logit(neutral, 10.0) - _logit(neutral, 2000.0)) < 1e-6
    recent, old = _logit(prefers_recent, 10.0), _logit(prefers_recent, 2000.0)
    # log(1 + 10) = 2.4, log(1 + 2000) = 7.6: the bias takes ~7 (recent) or ~23 (old) off CODE's score of 10,
    # against the sink and visit 1's OTHER token at 0: weight e^2.8 / (2 + e^2.8) = 0.89 vs ~1e-6.
    assert recent > 0.85 and old < 1e-4


def _token_level_reference(attention: TokenLabelAttention, hidden, token_ids, visit_index, ages, score_at):
    """The defining formula, one scored position and one token at a time (no per-visit grouping)."""
    out = []
    for b, p in score_at.nonzero().tolist():
        keys = attention.key(hidden[b]).view(-1, attention.num_heads, KEY_SIZE)  # (T, nh, k)
        votes = attention.value(hidden[b]).view(-1, attention.num_heads, attention.num_labels)  # (T, nh, L)
        logit = torch.zeros(attention.num_labels, dtype=torch.float64)
        for h in range(attention.num_heads):
            sink = (attention.query[h] @ attention.sink_key[h]) / KEY_SIZE**0.5  # (L,)
            scores, values = [sink], [attention.sink_value[h]]
            for t in range(p):
                if token_ids[b, t] < N_SPECIAL:
                    continue
                days = max(0.0, float(ages[b, p] - ages[b, t]) * DAYS_PER_YEAR)
                visits = max(0, int(visit_index[b, p] - visit_index[b, t]))
                e = attention.elapsed(
                    torch.tensor(
                        [[float(torch.log1p(torch.tensor(days))), float(torch.log1p(torch.tensor(float(visits))))]]
                    )
                )[0]
                score = attention.query[h] @ keys[t, h] / KEY_SIZE**0.5 + attention.time_bias[h] @ e
                value = votes[t, h] + e @ attention.time_value[:, h]
                if attention.label_token_ids is not None:  # the own-code prior
                    own = (attention.label_token_ids == token_ids[b, t]).float()  # (L,)
                    score, value = score + attention.own_score[h] * own, value + attention.own_vote[h] * own
                scores.append(score)
                values.append(value)
            weights = torch.softmax(torch.stack(scores), dim=0)  # (1 + tokens, L)
            logit += (weights * torch.stack(values)).sum(0).double()
        out.append(logit)
    return torch.stack(out)


def _random_case(own_code: bool) -> tuple[TokenLabelAttention, tuple[torch.Tensor, ...]]:
    """Random weights and two padded patients: visits of 2, 0 (a [SEP] with no code after truncation) and 3
    codes; every [SEP] scored."""
    torch.manual_seed(0)
    config = ModelConfig(
        label_code_tie=False,
        vocab_size=12,
        hidden_size=16,
        num_heads=2,
        label_attention_heads=2,
        label_own_code=own_code,
    )
    attention = TokenLabelAttention(config, num_labels=3, label_token_ids=torch.tensor([5, 8, 11]))
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0.0, 0.5)
    ids = [
        [CLS_ID, 5, 6, SEP_ID, SEP_ID, 7, 5, 9, SEP_ID],
        [CLS_ID, 8, SEP_ID, 8, 10, SEP_ID, 0, 0, 0],
    ]
    visits = [[0, 0, 0, 0, 1, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1, 0, 0, 0]]
    visit_ages = [[60.0, 60.5, 62.0], [30.0, 30.01]]
    token_ids, visit_index = torch.tensor(ids), torch.tensor(visits)
    ages = torch.tensor([[visit_ages[b][v] for v in row] for b, row in enumerate(visits)])
    return attention, (torch.randn(2, 9, 16), token_ids, visit_index, ages, token_ids == SEP_ID)


@pytest.mark.parametrize("own_code", [False, True])
def test_per_visit_form_equals_the_token_level_formula(own_code: bool):
    """Scoring sums each visit's tokens first; with random weights it must match the token-by-token softmax."""
    attention, batch = _random_case(own_code)
    with torch.no_grad():
        fast = attention(*batch)
        reference = _token_level_reference(attention, *batch)
    assert fast.shape == (5, 3)
    torch.testing.assert_close(fast.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [CHUNK_SCORES, 1])
def test_per_visit_form_has_the_token_level_formula_s_gradients(chunk: int, monkeypatch):
    """Training follows the same function: the gradients of every weight and of the hidden states match the
    token-by-token formula's, also when the scored visits are split into chunks of one."""
    monkeypatch.setattr(token_label_attention, "CHUNK_SCORES", chunk)
    attention, (hidden, *rest) = _random_case(own_code=True)
    hidden.requires_grad_(True)
    pull = torch.randn(5, 3, dtype=torch.float64)  # a random direction for the logits
    grads = []
    for formula in (attention, lambda *batch: _token_level_reference(attention, *batch)):
        attention.zero_grad()
        hidden.grad = None
        (formula(hidden, *rest).double() * pull).sum().backward()
        grads.append([hidden.grad.clone(), *(p.grad.clone() for p in attention.parameters())])
    for fast, reference in zip(*grads):
        torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-5)


def test_own_code_prior_finds_the_label_code_without_a_query():
    """With every learned weight at zero but the own-code biases, a label attends to and votes from the
    records of its own code, and only those: another code's records leave it at the sink."""
    config = ModelConfig(
        label_code_tie=False,
        vocab_size=10,
        hidden_size=KEY_SIZE,
        num_heads=2,
        label_attention_heads=1,
        label_own_code=True,
    )
    attention = TokenLabelAttention(config, num_labels=2, label_token_ids=torch.tensor([CODE, OTHER + 1]))
    with torch.no_grad():
        for p in attention.parameters():
            p.zero_()
        attention.own_score.fill_(12.0)
        attention.own_vote.fill_(1.0)
    batch = _patient(30.0)  # CODE once, OTHER twice, never OTHER + 1
    with torch.no_grad():
        logits = attention(
            torch.zeros(1, 6, KEY_SIZE), batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"]
        )
    assert logits[0, 0] > 0.99  # nearly all weight on the one CODE record, whose own-code vote is 1
    assert logits[0, 1] == 0.0  # nothing of its own code: no vote


def test_own_code_ids_must_match_the_labels():
    config = ModelConfig(
        label_code_tie=False, vocab_size=10, hidden_size=16, num_heads=2, label_attention_heads=1, label_own_code=True
    )
    with pytest.raises(ValueError, match="must hold 3 ids"):
        TokenLabelAttention(config, num_labels=3, label_token_ids=torch.tensor([4, 5]))
