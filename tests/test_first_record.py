"""The first-record marker of the label attention (``model.label_first_record``): which tokens it marks, that
it only ever looks back, that the head starts as without it, and that it lets a label read how long a code has
been on file rather than how recently it was recorded."""

from __future__ import annotations

import torch

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.token_label_attention import KEY_SIZE, TokenLabelAttention, first_records
from behrt_rope.schema import CLS_ID, N_SPECIAL, PAD_ID, SEP_ID

CODE, OTHER = N_SPECIAL, N_SPECIAL + 1
DAYS_PER_YEAR = 365.25


def test_marks_the_first_record_of_each_code_only():
    ids = torch.tensor([[CLS_ID, CODE, OTHER, SEP_ID, CODE, SEP_ID, OTHER, CODE + 2, SEP_ID, PAD_ID]])
    assert first_records(ids).int().tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 0, 0]]


def test_a_history_cut_anywhere_is_marked_as_in_the_whole_row():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N_SPECIAL + 6, (4, 40), generator=generator)
    whole = first_records(ids)
    for cut in range(1, 41):
        assert torch.equal(first_records(ids[:, :cut]), whole[:, :cut])
    assert not whole[ids < N_SPECIAL].any()  # special tokens and padding are never marked


def _config(first_record: bool) -> ModelConfig:
    return ModelConfig(
        label_code_tie=False,
        label_own_code=False,
        label_first_record=first_record,
        label_time_steps=False,  # GELU ramps: e[0] is GELU(log(1 + days)) in the test below
        vocab_size=12,
        hidden_size=KEY_SIZE,
        num_heads=2,
        label_attention_heads=1,
    )


def _two_records(first_visit: int) -> dict[str, torch.Tensor]:
    """Three yearly visits (ages 48, 49, 50), each with OTHER; CODE also at ``first_visit`` and at visit 2.
    Scored at the last [SEP]."""
    ids, visits, ages = [CLS_ID], [0], [48.0]
    for visit in range(3):
        codes = [OTHER] + ([CODE] if visit in (first_visit, 2) else [])
        ids += [*codes, SEP_ID]
        visits += [visit] * (len(codes) + 1)
        ages += [48.0 + visit] * (len(codes) + 1)
    score_at = [False] * (len(ids) - 1) + [True]
    return {
        "token_ids": torch.tensor([ids]),
        "visit_index": torch.tensor([visits]),
        "ages": torch.tensor([ages]),
        "score_at": torch.tensor([score_at]),
    }


def _logit(attention: TokenLabelAttention, batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> float:
    with torch.no_grad():
        return float(attention(hidden, batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"]))


def test_starts_as_the_head_without_it():
    torch.manual_seed(0)
    without = TokenLabelAttention(_config(False), num_labels=3)
    marked = TokenLabelAttention(_config(True), num_labels=3)
    with torch.no_grad():
        for p in without.parameters():
            p.normal_()
    zeros = {"first_score": torch.zeros(1, 3), "first_vote": torch.zeros(1, 3)}
    marked.load_state_dict({**without.state_dict(), **zeros})
    batch = _two_records(first_visit=0)
    hidden = torch.randn(1, batch["token_ids"].shape[1], KEY_SIZE)
    with torch.no_grad():
        args = (batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"])
        assert torch.equal(marked(hidden, *args), without(hidden, *args))


def test_lets_a_label_read_how_long_its_code_has_been_on_file():
    """States are all zero; the first-record score bias alone steers the attention, and the vote is
    log(1 + days since the attended record): the logit then tells a code first recorded two years ago from
    one first recorded a year ago, though both were last recorded at the scored visit."""
    attention = TokenLabelAttention(_config(True), num_labels=1)
    with torch.no_grad():
        for p in attention.parameters():
            p.zero_()
        attention.first_score[0, 0] = 10.0  # score 10 on a first record, 0 elsewhere
        attention.elapsed[0].weight[0, 0] = 1.0  # e[0] = GELU(log(1 + days))
        attention.time_value[0, 0, 0] = 1.0  # vote e[0]
    two_years, one_year = _two_records(first_visit=0), _two_records(first_visit=1)
    hidden_of = lambda batch: torch.zeros(1, batch["token_ids"].shape[1], KEY_SIZE)  # noqa: E731
    older, newer = _logit(attention, two_years, hidden_of(two_years)), _logit(attention, one_year, hidden_of(one_year))
    days = torch.log1p(torch.tensor([2 * DAYS_PER_YEAR, DAYS_PER_YEAR]))
    # Nearly all weight on the first record of each of its codes (CODE and OTHER, both first seen at visit 0
    # in the older history): the vote is the mean log-days of those first records.
    assert older > newer
    assert abs(older - float(days[0])) < 0.05
    assert abs(newer - float((days[0] + days[1]) / 2)) < 0.05


def test_tied_head_gives_the_first_record_biases_label_code_offsets():
    """With label-code tying the biases get offsets from the label codes (zero at the start, then learned)."""
    config = ModelConfig(
        label_code_tie=True,
        label_first_record=True,
        vocab_size=12,
        hidden_size=16,
        num_heads=2,
        label_attention_heads=2,
    )
    attention = TokenLabelAttention(config, num_labels=3)
    vectors = torch.randn(3, 16)
    params = attention.label_parameters(vectors)
    assert params.first_score is not None and params.first_score.shape == (2, 3)
    assert torch.equal(params.first_score, attention.first_score)  # the shared maps start at zero
    assert attention.tie is not None
    with torch.no_grad():
        for p in attention.tie.parameters():
            p.fill_(0.1)
    moved = attention.label_parameters(vectors)
    assert moved.first_vote is not None and not torch.equal(moved.first_vote, attention.first_vote)
