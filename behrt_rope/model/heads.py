"""Task heads on the encoder: masked-code pre-training and multi-label diagnosis prediction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import BehrtEncoder, init_weights, positions_for
from behrt_rope.model.label_attention import LabelAttention
from behrt_rope.model.label_codes import LabelCodeMaps, label_vectors
from behrt_rope.model.sparse_time_path import SparseTimePath
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.model.state_path import StatePath
from behrt_rope.model.token_label_attention import TokenLabelAttention, label_id_tensor
from behrt_rope.model.wide import WidePath
from behrt_rope.schema import PAD_ID, SEP_ID

IGNORE_INDEX = -100
"""Label of the tokens that the MLM loss skips (PyTorch's ``cross_entropy`` default)."""


class MaskedLMOutput(NamedTuple):
    """What :class:`BehrtForMaskedLM` returns; ``N`` is the number of chosen tokens in the batch."""

    loss: torch.Tensor
    """Scalar mean cross-entropy over the chosen tokens (0, still attached to the graph, when ``N == 0``)."""
    logits: torch.Tensor
    """``(N, V)`` code logits at the chosen tokens, in row-major order of the batch."""
    labels: torch.Tensor
    """``(N,)`` long original ids at the chosen tokens, aligned with ``logits``."""


class BehrtForMaskedLM(nn.Module):
    """Encoder + BERT's MLM head: dense, GELU, LayerNorm, then a decoder tied to the code embedding + a bias.

    Tying: the decoder multiplies by ``encoder.embeddings.code.weight`` itself (``F.linear``), so there is one
    weight matrix, one entry in the state dict, and nothing to re-tie after loading.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = BehrtEncoder(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.gelu = nn.GELU()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab_size))
        for module in (self.dense, self.norm):
            module.apply(init_weights)

    def forward(
        self,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        segments: torch.Tensor,
        visit_index: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> MaskedLMOutput:
        """Predict the original code at the chosen tokens.

        Args:
            token_ids, ages, segments, visit_index, attention_mask, sex: as :meth:`BehrtEncoder.forward`, with
                ``token_ids`` already masked (see ``behrt_rope.data.masking.mask_tokens``).
            labels: ``(B, T)`` long original ids at the chosen tokens, ``-100`` elsewhere.

        Only the chosen rows (about 15% of the real tokens) go through the head and the ``V``-wide decoder,
        which is most of the head's cost.
        """
        hidden = self.encoder(token_ids, ages, segments, visit_index, attention_mask, sex=sex)  # (B, T, H)
        chosen = labels != IGNORE_INDEX  # (B, T)
        h = hidden[chosen]  # (N, H)
        h = self.norm(self.gelu(self.dense(h)))  # (N, H)
        logits = F.linear(h, self.encoder.embeddings.code.weight, self.decoder_bias)  # (N, V)
        targets = labels[chosen]  # (N,)
        # Sum / max(N, 1) instead of the mean: a batch with nothing chosen gives 0, not NaN.
        loss = F.cross_entropy(logits.float(), targets, reduction="sum") / max(targets.numel(), 1)
        return MaskedLMOutput(loss=loss, logits=logits, labels=targets)


class BehrtForMultiLabel(nn.Module):
    """Encoder + pooling + dropout + linear: one logit per label (e.g. diagnoses in the next visit).

    Poolings:

    * ``"visit"`` (default): the encoder runs visit-causally (tokens see only their own and earlier visits)
      and the state of a visit's [SEP] summarises the history up to and including that visit. One pass over
      a patient scores every prediction time at once: pass ``score_at`` (B, T) bool marking the [SEP]
      tokens to score. The classifier reads the [SEP] state, the mean (and max) state of the history, the
      Time2Vec features of the age at that visit and a learned basis of that age. A label-wise attention over
      the history (``config.label_attention_heads``, see ``token_label_attention.py``) adds one more logit per
      label, from the codes that label's query picks out, weighed by how many visits and days ago they were
      recorded. The *wide* linear path (Cheng et al., 2016, "Wide & Deep"; ``config.wide``, see ``wide.py``)
      adds a logit from log(1 + count) of every code seen so far and, with ``config.wide_time``, from how
      often, how recently and for how long each label's own code has been recorded. The *sparse time*
      path (``config.sparse_time``, see ``sparse_time_path.py``), an L1 logistic regression on binned timing
      of every label code fitted before the deep training and frozen, is averaged with all of the above.
      With ``config.state_filter``, a learned hidden-state chain per label, filtered over the visits
      (``state_filter.py``), adds one more logit per label to the deep part.
      With ``config.state_path``, the same chains as a path of their own (``state_path.py``), fitted after the
      deep part and averaged with the above at a share chosen on the tuning split.
      With ``config.label_own_code`` or ``config.wide_time``, pass ``label_token_ids`` ``(L,)``: the token id
      of each label's code (a trained model's state dict carries them).
    * ``"cls"``: the ``[CLS]`` state (position 0) of a bidirectional pass over the input (one prediction
      time per sequence, the input cut at it), as BEHRT did.
    * ``"mean"``: the mean of the real tokens' states of a bidirectional pass.
    """

    label_codes: torch.Tensor | None  # (L,) long buffer with config.label_code_tie, else None

    def __init__(
        self,
        config: ModelConfig,
        num_labels: int,
        pooling: Literal["visit", "cls", "mean"] = "visit",
        label_token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_labels <= 0:
            raise ValueError(f"num_labels must be positive, got {num_labels}")
        if pooling not in ("visit", "cls", "mean"):
            raise ValueError(f"pooling must be 'visit', 'cls' or 'mean', got {pooling!r}")
        self.config = config
        self.num_labels = num_labels
        self.pooling = pooling
        self.encoder = BehrtEncoder(config)
        self.drop = nn.Dropout(config.dropout)
        visit = pooling == "visit"
        history_parts = 3 if config.history_max else 2  # [SEP] state, history mean (, history max)
        age_parts = config.time2vec_periodic + 1 + config.age_basis
        pooled_size = history_parts * config.hidden_size + age_parts if visit else config.hidden_size
        self.age_basis = (
            nn.Sequential(nn.Linear(2, config.age_basis), nn.GELU()) if visit and config.age_basis else None
        )
        self.classifier = nn.Linear(pooled_size, num_labels)
        self.classifier.apply(init_weights)
        # Label-code tying (config.label_code_tie, ``label_codes.py``): the classifier's rows get offsets from
        # each label's code embedding; the label codes are a buffer, so a trained model carries them.
        tie = visit and config.label_code_tie
        self.register_buffer("label_codes", label_id_tensor(num_labels, label_token_ids) if tie else None)
        self.classifier_tie = LabelCodeMaps(config.hidden_size, {"weight": pooled_size}) if tie else None
        self.wide = None
        if visit and config.wide:
            self.wide = WidePath(config.vocab_size, num_labels, config.wide_time, label_token_ids)
        self.sparse_time = SparseTimePath(num_labels, label_token_ids) if visit and config.sparse_time else None
        self.state_filter = None
        if visit and config.state_filter:
            self.state_filter = HiddenStateFilter(config.vocab_size, num_labels, config.state_filter)
        self.state_path = None
        if visit and config.state_path:
            self.state_path = StatePath(
                config.vocab_size,
                num_labels,
                config.state_path,
                label_token_ids,
                config.state_path_copies,
                config.state_path_reach,
            )
            self.state_path.requires_grad_(False)  # fitted apart (training/state_path_fit.py), after the deep part
        use_label_attention = visit and config.label_attention_heads > 0
        self.label_attention: LabelAttention | TokenLabelAttention | None = None
        if use_label_attention and config.label_attention_keys == "token":
            ids = None if label_token_ids is None else torch.as_tensor(label_token_ids, dtype=torch.long)
            self.label_attention = TokenLabelAttention(config, num_labels, ids)
        elif use_label_attention:
            self.label_attention = LabelAttention(config, num_labels)
            self.label_attention.key.apply(init_weights)
            for layer in (self.label_attention.elapsed[0], self.label_attention.vote[0]):
                layer.apply(init_weights)

    def pool(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden`` ``(B, T, H)``, ``attention_mask`` ``(B, T)`` bool -> ``(B, H)``; or, for ``"visit"``
        pooling, the features of :meth:`_visit_features` at the ``N`` positions of ``score_at`` (row-major
        order)."""
        if self.pooling == "visit":
            if score_at is None:
                raise ValueError("visit pooling needs score_at: the [SEP] positions to score")
            return self._visit_features(hidden, ages, score_at)
        if self.pooling == "cls":
            return hidden[:, 0]  # (B, H)
        weights = attention_mask.to(hidden.dtype)[..., None]  # (B, T, 1)
        total = (hidden * weights).sum(dim=1)  # (B, H)
        return total / weights.sum(dim=1).clamp(min=1.0)  # (B, H); an all-padding row pools to 0

    def _visit_features(self, hidden: torch.Tensor, ages: torch.Tensor, score_at: torch.Tensor) -> torch.Tensor:
        """``(N, 2H + k + 1 + A)``: the [SEP] state, the mean state of the history, Time2Vec of the age and
        ``A = config.age_basis`` learned features of the age; with ``config.history_max``, ``(N, 3H + k + 1 + A)``:
        also the elementwise max over the history's states.

        A mean over ``n`` tokens shrinks one recorded code's trace ``n`` times; the max keeps it at full
        size however long the history, so "was it ever recorded" is as easy to read at visit 30 as at
        visit 2. The stream is ordered by visit and padding comes last, so the history of the [SEP] at
        position ``p`` is exactly the real tokens ``0..p``: its mean and max are a running sum (over ``p + 1``)
        and a running max along the row, O(T H) per patient.
        """
        positions = score_at.nonzero()[:, 1]  # (N,) the scored positions, row-major
        count = positions[:, None].to(hidden.dtype) + 1.0  # (N, 1): tokens in each scored history
        years = ages[score_at]  # (N,)
        age = self.encoder.embeddings.age.features(years).to(hidden.dtype)  # (N, k + 1)
        parts = [hidden[score_at]]
        if len(positions) == len(hidden) and bool((score_at.sum(dim=1) == 1).all()):
            # One scored visit per row (predict): a masked sum and max over each row's history, not running
            # ones over every position.
            history = torch.arange(hidden.shape[1], device=hidden.device)[None, :] <= positions[:, None]  # (B, T)
            parts.append((hidden * history[..., None]).sum(dim=1) / count)  # (B, H)
            if self.config.history_max:
                parts.append(hidden.masked_fill(~history[..., None], float("-inf")).amax(dim=1))  # (B, H)
        else:
            parts.append(hidden.cumsum(dim=1)[score_at] / count)  # (N, H)
            if self.config.history_max:
                parts.append(torch.cummax(hidden, dim=1).values[score_at])  # (N, H)
        parts.append(age)
        if self.age_basis is not None:
            x = years.float()[:, None]  # (N, 1)
            scaled = torch.cat([x / 10.0, torch.log1p(x.clamp(min=0.0))], dim=-1)  # (N, 2)
            parts.append(self.age_basis(scaled).to(hidden.dtype))  # (N, age_basis)
        return torch.cat(parts, dim=-1)

    def forward(
        self,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        segments: torch.Tensor,
        visit_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        score_at: torch.Tensor | None = None,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Batch fields as :meth:`BehrtEncoder.forward` -> logits (before the sigmoid): ``(B, num_labels)``,
        or ``(N, num_labels)`` at the ``score_at`` positions with ``"visit"`` pooling.

        With the sparse time path, a weighted mean of its logits and :meth:`deep_logits` (the path's weight
        is its ``share``): the two are fitted apart (the deep part is trained on its own logits, the path is
        fixed before training) and averaged, which on the tuning splits beat training the deep part on the
        path's residual (docs/benchmarks.md, "Tenth round"). With the state path at a share above 0, that mean
        is averaged again with :meth:`state_logits`."""
        logits = self.deep_logits(token_ids, ages, segments, visit_index, attention_mask, score_at, sex)
        path = states = None
        if self.sparse_time is not None:
            path = self.path_logits(token_ids, visit_index, ages, score_at, sex)
        if self.uses_state_path:
            states = self.state_logits(token_ids, visit_index, ages, score_at, sex)
        if path is None and states is None:
            return logits
        return self.mix_logits(logits, path, states)

    @property
    def uses_state_path(self) -> bool:
        """Whether the state path is part of the model's logit (it has one and its share is above 0)."""
        return self.state_path is not None and float(self.state_path.share) > 0.0

    def mix_logits(
        self,
        deep: torch.Tensor,
        path: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
        with_path: bool = True,
    ) -> torch.Tensor:
        """The model's logit from :meth:`deep_logits`, :meth:`path_logits` and :meth:`state_logits` (each
        ``(N, L)``), in float32: ``(1 - p) * deep + p * path`` with ``p`` the sparse time path's share, then
        ``(1 - s) * that + s * states`` with ``s`` the state path's (skipped at 0). An error when a part the
        model mixes is missing. ``with_path=False``: the same mix with the sparse time path left out,
        ``(1 - s) * deep + s * states``: the model without its hand-made time features, every part of it
        learned from the token stream."""
        logits = deep.float()
        if self.sparse_time is not None and with_path:
            if path is None:
                raise ValueError("mix_logits needs the sparse time path's logits (model.sparse_time)")
            share = self.sparse_time.share
            logits = (1.0 - share) * logits + share * path
        if self.uses_state_path:
            assert self.state_path is not None
            if states is None:
                raise ValueError("mix_logits needs the state path's logits (model.state_path)")
            share = self.state_path.share
            logits = (1.0 - share) * logits + share * states
        return logits

    def state_logits(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor | None,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The state path's ``(N, L)`` float32 logits alone (an error without it)."""
        if self.state_path is None or score_at is None:
            raise ValueError("state_logits needs the state path (model.state_path) and score_at")
        return self.state_path(token_ids, visit_index, ages, score_at, sex)

    def path_logits(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor | None,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The sparse time path's ``(N, L)`` float32 logits alone (an error without the path)."""
        if self.sparse_time is None or score_at is None:
            raise ValueError("path_logits needs the sparse time path (model.sparse_time) and score_at")
        return self.sparse_time(token_ids, visit_index, ages, score_at, sex)

    def deep_logits(
        self,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        segments: torch.Tensor,
        visit_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        score_at: torch.Tensor | None = None,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits of the deep part: the encoder and its fine-tuning head, without the sparse time path
        and the state path; arguments and shapes as :meth:`forward`."""
        if attention_mask is None:
            attention_mask = token_ids != PAD_ID
        if self.pooling != "visit":
            hidden = self.encoder(token_ids, ages, segments, visit_index, attention_mask, sex=sex)  # (B, T, H)
            return self.classifier(self.drop(self.pool(hidden, attention_mask, visit_index, ages)))
        if score_at is None:
            raise ValueError("visit pooling needs score_at: the [SEP] positions to score")
        hidden = self.encoder(token_ids, ages, segments, visit_index, attention_mask, visit_causal=True, sex=sex)
        return self.visit_head_logits(hidden, token_ids, ages, visit_index, score_at, sex)

    def visit_head_logits(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        visit_index: torch.Tensor,
        score_at: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The deep part's ``(N, L)`` logits from the ``(B, T, H)`` states of a visit-causal encoder pass
        (visit pooling): everything :meth:`deep_logits` does after the encoder, so that a head can be scored or
        trained on states computed once (e.g. ``benchmarks/head_refit.py``)."""
        features = self._visit_features(hidden, ages, score_at)  # (N, P)
        vectors = None
        if self.label_codes is not None and self.classifier_tie is not None:
            vectors = label_vectors(self.encoder.embeddings.code.weight, self.label_codes)  # (L, H)
            weight = self.classifier.weight + self.classifier_tie(vectors)["weight"]  # (L, P)
            logits = F.linear(self.drop(features), weight.to(features.dtype), self.classifier.bias.to(features.dtype))
        else:
            logits = self.classifier(self.drop(features))  # (N, L)
        if isinstance(self.label_attention, TokenLabelAttention):
            logits = logits + self.label_attention(
                self.drop(hidden), token_ids, visit_index, ages, score_at, label_vectors=vectors
            )
        elif self.label_attention is not None:
            positions = positions_for(self.config, visit_index, ages)  # (B, T)
            visit_end = token_ids == SEP_ID  # (B, T)
            logits = logits + self.label_attention(self.drop(hidden), visit_end, positions, ages, score_at)
        if self.wide is not None:
            logits = logits + self.wide(token_ids, visit_index, ages, score_at).to(logits.dtype)  # (N, L)
        if self.state_filter is not None:
            logits = logits + self.state_filter(token_ids, visit_index, ages, score_at, sex).to(logits.dtype)
        return logits


def multilabel_loss(
    logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean binary cross-entropy over ``(B, L)`` logits and 0/1 targets; computed in float32.

    ``pos_weight`` ``(L,)`` multiplies the positive term of each label (see :func:`pos_weight_from_counts`),
    to counter rare labels.
    """
    weight = None if pos_weight is None else pos_weight.to(device=logits.device, dtype=torch.float32)
    return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), pos_weight=weight)


def pos_weight_from_counts(positives: torch.Tensor, total: int, max_weight: float | None = None) -> torch.Tensor:
    """``negatives / positives`` per label, ``(L,)`` float32: balances each label's two BCE terms.

    A label never positive gets weight 1 (there is nothing to up-weight); ``max_weight`` caps the rest.

    >>> pos_weight_from_counts(torch.tensor([10, 50, 0]), total=100).tolist()
    [9.0, 1.0, 1.0]
    """
    positives = positives.float()
    ratio = (total - positives) / positives.clamp(min=1.0)  # (L,)
    weight = torch.where(positives > 0, ratio, torch.ones_like(ratio))
    return weight if max_weight is None else weight.clamp(max=max_weight)


def load_encoder_weights(
    target: nn.Module, source_state_dict: Mapping[str, torch.Tensor], prefix: str = "encoder."
) -> list[str]:
    """Copy a pre-trained encoder into ``target``'s encoder, to start fine-tuning from MLM pre-training.

    Args:
        target: a :class:`BehrtEncoder`, or a model with an ``encoder`` attribute (e.g.
            :class:`BehrtForMultiLabel`).
        source_state_dict: e.g. ``BehrtForMaskedLM.state_dict()``; only the keys under ``prefix`` are used
            (the MLM head is dropped). Pass ``prefix=""`` for a bare encoder's state dict.
        prefix: the encoder's key prefix in ``source_state_dict``.

    Returns:
        The encoder keys loaded. Raises if the source has no key under ``prefix``, or if the encoder's keys or
        shapes differ (strict loading: a config mismatch is an error, not a silent partial load).
    """
    encoder = target if isinstance(target, BehrtEncoder) else target.encoder
    if not isinstance(encoder, BehrtEncoder):
        raise TypeError(f"target must be a BehrtEncoder or have one as .encoder, got {type(target).__name__}")
    state = {key[len(prefix) :]: value for key, value in source_state_dict.items() if key.startswith(prefix)}
    if not state:
        raise ValueError(f"no key of the source state dict starts with {prefix!r}")
    encoder.load_state_dict(state, strict=True)
    return sorted(state)
