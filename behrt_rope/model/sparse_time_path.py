"""The sparse time path of the fine-tuning head: a frozen L1 logistic regression on binned time features.

The features are those of the sparse time regression reference (``behrt_rope/evaluation/sparse_time.py``),
computed here from the token stream so that a trained model carries them (``predict``, the batch scorer
and Ray need nothing else). At each scored visit, over the ``L`` label codes:

* per label ``j``, its own code (20 columns): ever recorded, ``log(1 + visits with it)``, visits since last
  recorded in bins (0, 1, ..., 5+), days since in bins (edges 30, 90, 365, 1,095), years since first recorded
  in bins (edges 1, 2, 3, 5, 8), recorded at the scored visit;
* shared by all labels (``7 L + 18`` columns): every label code's years-since-first bins (0 when never) and
  recorded-at-the-scored-visit flag, then age in 10-year bins, sex (female, male, other), ``log(1 + visits
  so far)`` and days since the previous visit in bins (edges 14, 30, 90, 365; none at a first visit).

The weights are not trained by gradient descent: ``finetune`` fits them with scikit-learn before the deep
training (:func:`behrt_rope.evaluation.sparse_time.fit_sparse_time`) and loads them with :meth:`load_fit`;
they are buffers, saved and loaded with the rest of the model. The deep part is trained on its own
logits, and the model's logit is a weighted mean of the two (two different learners, each with its own
errors): the path's ``share`` is 0.5 during training and is then chosen on the tuning split. An L1 prior
finds the few cross-code timing effects that matter among many, which neither the transformer nor gradient
boosting found on our tuning cohorts (docs/benchmarks.md, "Ninth round").

Shapes: ``B`` patients, ``T`` tokens, ``N`` scored positions, ``L`` labels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from behrt_rope.model.encoder import DAYS_PER_YEAR
from behrt_rope.model.path_share import SharedPath
from behrt_rope.model.token_label_attention import label_id_tensor
from behrt_rope.model.visit_gap import visit_ages
from behrt_rope.model.wide import HistoryPairs, history_pairs

VISITS_EDGES = (0.5, 1.5, 2.5, 3.5, 4.5)
"""Visits since a code was last recorded: 0 (at the scored visit), 1, 2, 3, 4, 5 or more."""
DAYS_EDGES = (30.0, 90.0, 365.0, 1095.0)
"""Days since a code was last recorded."""
YEARS_EDGES = (1.0, 2.0, 3.0, 5.0, 8.0)
"""Years since a code was first recorded."""
AGE_EDGES = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0)
"""Age at the prediction time, years."""
GAP_EDGES = (14.0, 30.0, 90.0, 365.0)
"""Days since the previous visit."""
SEX_IDS = (1, 2, 3)
"""Sex ids with a column (``schema.SEX_VALUES`` positions: female, male, other; 0, unknown, has none)."""
OWN_COLUMNS = 2 + len(VISITS_EDGES) + 1 + len(DAYS_EDGES) + 1 + len(YEARS_EDGES) + 1 + 1
"""20: ever, log count, visits-since bins, days-since bins, years-since-first bins, at the scored visit."""
PER_CODE_COLUMNS = len(YEARS_EDGES) + 2
"""7 shared columns per label code: years-since-first bins, at the scored visit."""
SAMPLE_COLUMNS = len(AGE_EDGES) + 1 + len(SEX_IDS) + 1 + len(GAP_EDGES) + 1
"""18 shared columns per sample: age bins, sex, log visits, gap bins."""


def shared_columns(num_labels: int) -> int:
    """Width of the shared design for ``num_labels`` label codes: ``7 L + 18``."""
    return PER_CODE_COLUMNS * num_labels + SAMPLE_COLUMNS


class SparseTimePath(SharedPath):
    """Binned time features at each scored position, times fitted frozen weights -> ``(N, L)`` logits."""

    label_token_ids: torch.Tensor  # (L,) long: the token id of each label's code (-1: none)
    own_weight: torch.Tensor  # (L, 20) float32
    shared_weight: torch.Tensor  # (L, 7 L + 18) float32
    bias: torch.Tensor  # (L,) float32
    path_name = "sparse time path"

    def __init__(self, num_labels: int, label_token_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        # The model's logit is (1 - share) * deep part + share * path; finetune chooses it on the tuning split.
        super().__init__(share=0.5)
        self.num_labels = num_labels
        self.register_buffer("label_token_ids", label_id_tensor(num_labels, label_token_ids))
        # Zero until fitted: an unfitted path adds nothing.
        self.register_buffer("own_weight", torch.zeros(num_labels, OWN_COLUMNS))
        self.register_buffer("shared_weight", torch.zeros(num_labels, shared_columns(num_labels)))
        self.register_buffer("bias", torch.zeros(num_labels))

    def load_fit(self, own_weight: torch.Tensor, shared_weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Set the fitted weights: ``(L, 20)``, ``(L, 7 L + 18)`` and ``(L,)`` (logit scale)."""
        for name, value in (("own_weight", own_weight), ("shared_weight", shared_weight), ("bias", bias)):
            target = getattr(self, name)
            value = torch.as_tensor(value, dtype=torch.float32)
            if value.shape != target.shape:
                raise ValueError(f"{name} must have shape {tuple(target.shape)}, got {tuple(value.shape)}")
            target.copy_(value)

    def forward(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, T)`` ids, visit numbers, ages in years, the scored [SEP] mask and sex ids -> ``(N, L)``
        float32 logits (rows in row-major order of ``score_at``). Always in float32, also under autocast: the
        logit is a sum of hundreds of fitted terms."""
        with torch.autocast(token_ids.device.type, enabled=False):
            own, shared = self.features(token_ids, visit_index, ages, score_at, sex)
            return (own * self.own_weight).sum(-1) + shared @ self.shared_weight.T + self.bias

    def features(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N, L, 20)`` own-code and ``(N, 7 L + 18)`` shared columns, float32 (see the module docstring)."""
        pairs = history_pairs(token_ids, score_at)
        stats = self._label_code_stats(pairs, visit_index, ages)
        ever = stats["count"] > 0  # (N, L)
        visit_bins = _bins(stats["visits_since"], VISITS_EDGES, ever)
        day_bins = _bins(stats["days_since"], DAYS_EDGES, ever)
        year_bins = _bins(stats["days_since_first"] / DAYS_PER_YEAR, YEARS_EDGES, ever)
        in_last = (ever & (stats["visits_since"] == 0)).float()[..., None]  # (N, L, 1)
        own = torch.cat(
            [ever.float()[..., None], torch.log1p(stats["count"])[..., None], visit_bins, day_bins, year_bins, in_last],
            dim=-1,
        )
        timing = torch.cat([year_bins, in_last], dim=-1).flatten(1)  # (N, 7 L)
        return own, torch.cat([timing, _sample_columns(token_ids, visit_index, ages, score_at, sex)], dim=1)

    def _label_code_stats(
        self, pairs: HistoryPairs, visit_index: torch.Tensor, ages: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per (scored position, label) ``(N, L)`` float32: visits recording the label's code, visits and days
        since the last record and days since the first (undefined where the count is 0)."""
        device = pairs.code.device
        pairs, label = pairs.of_labels(self.label_token_ids)
        slot = pairs.sample * self.num_labels + label  # (P',) flat (scored position, label) index
        visits, days = pairs.visits(visit_index), _whole_days(pairs.days(ages))  # (P',)
        record_visit = visit_index[pairs.patient, pairs.position]  # (P',)
        # a code counted once per visit even if a hand-built stream repeats it inside one
        span = int(visit_index.max()) + 1
        distinct = torch.unique(slot * span + record_visit)  # (sample, label, visit) once each
        size = pairs.n * self.num_labels
        count = torch.zeros(size, device=device).index_add(
            0, distinct // span, torch.ones(len(distinct), device=device)
        )
        far = torch.full((size,), float("inf"), device=device)
        stats = {
            "count": count,
            "visits_since": far.scatter_reduce(0, slot, visits, reduce="amin"),
            "days_since": far.scatter_reduce(0, slot, days, reduce="amin"),
            "days_since_first": torch.zeros(size, device=device).scatter_reduce(0, slot, days, reduce="amax"),
        }
        return {name: value.view(pairs.n, self.num_labels) for name, value in stats.items()}


def _whole_days(days: torch.Tensor) -> torch.Tensor:
    """Visits are dated to the day and ages are ``days / 365.25`` in float32: rounding recovers the exact
    whole days, so a gap of exactly 30 days falls in the same bin as in the reference's integer days."""
    return torch.round(days)


def _bins(values: torch.Tensor, edges: tuple[float, ...], present: torch.Tensor) -> torch.Tensor:
    """One-hot bins ``values.shape + (len(edges) + 1,)`` float32, zeros where not ``present``; a value equal
    to an edge goes to the bin above it (as ``numpy.digitize``)."""
    boundaries = torch.tensor(edges, dtype=torch.float32, device=values.device)
    index = torch.bucketize(values.float(), boundaries, right=True)
    return nn.functional.one_hot(index, len(edges) + 1).float() * present[..., None].float()


def _sample_columns(
    token_ids: torch.Tensor,
    visit_index: torch.Tensor,
    ages: torch.Tensor,
    score_at: torch.Tensor,
    sex: torch.Tensor | None,
) -> torch.Tensor:
    """``(N, 18)``: age bins, sex, ``log(1 + visits so far)``, bins of the days since the previous visit."""
    age = ages[score_at].float()  # (N,)
    k = visit_index[score_at]  # (N,)
    everyone = torch.ones_like(age, dtype=torch.bool)
    sex_ids = sex[score_at] if sex is not None else torch.zeros_like(k)
    sex_columns = torch.stack([sex_ids == value for value in SEX_IDS], dim=1).float()  # (N, 3)
    visit_age = visit_ages(token_ids, visit_index, ages)  # (B, V)
    rows = score_at.nonzero(as_tuple=True)[0]
    previous = visit_age[rows, (k - 1).clamp(min=0)]  # (N,)
    gap = _whole_days((age - previous) * DAYS_PER_YEAR)
    return torch.cat(
        [
            _bins(age, AGE_EDGES, everyone),
            sex_columns,
            torch.log1p(k.float() + 1.0)[:, None],
            _bins(gap, GAP_EDGES, k > 0),
        ],
        dim=1,
    )
