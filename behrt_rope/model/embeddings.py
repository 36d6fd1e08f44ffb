"""The input embedding: code + segment + Time2Vec(age) + sex (+ the days since the previous visit; + a sinusoidal
position table in the ablation)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.rope import sinusoidal_table
from behrt_rope.model.time2vec import Time2Vec
from behrt_rope.model.visit_gap import VisitGapEmbedding
from behrt_rope.schema import N_SPECIAL, PAD_ID, SEX_VALUES


class BehrtEmbeddings(nn.Module):
    """Sum of the token's code, segment and age embeddings, then LayerNorm and dropout, as in BEHRT; with
    ``config.sex_embedding``, plus an embedding of the patient's sex (its ``unknown`` row is zero).

    With ``position_encoding="rope"`` no position enters here: positions act only inside attention, by
    rotating queries and keys. With ``"absolute"`` (the ablation) BEHRT's fixed sinusoidal table, indexed by
    the rounded position, is added too. The table is a non-persistent buffer, so both settings have the same
    state dict.
    """

    position_table: torch.Tensor  # (max_positions, H), registered only with position_encoding="absolute"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.vocab_size <= N_SPECIAL:
            raise ValueError(f"vocab_size {config.vocab_size} must exceed the {N_SPECIAL} special tokens")
        self.code = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=PAD_ID)
        self.segment = nn.Embedding(config.num_segments, config.hidden_size)
        self.age = Time2Vec.of_age(config)
        self.sex = nn.Embedding(len(SEX_VALUES), config.hidden_size, padding_idx=0) if config.sex_embedding else None
        self.visit_gap = VisitGapEmbedding(config) if config.visit_gap else None
        self.absolute = config.position_encoding == "absolute"
        if self.absolute:
            table = sinusoidal_table(config.max_positions, config.hidden_size)  # (max_positions, H)
            self.register_buffer("position_table", table, persistent=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.code_scale = math.sqrt(config.hidden_size) if config.scale_code_embedding else 1.0

    def forward(
        self,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        segments: torch.Tensor,
        positions: torch.Tensor | None = None,
        sex: torch.Tensor | None = None,
        visit_gap: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Embed one batch.

        Args:
            token_ids: ``(B, T)`` long vocabulary ids.
            ages: ``(B, T)`` float ages in years.
            segments: ``(B, T)`` long segment ids in ``[0, num_segments)``.
            positions: ``(B, T)`` float positions; used (and required) only with
                ``position_encoding="absolute"``.
            sex: ``(B, T)`` long sex ids (``schema.SEX_VALUES`` positions, 0 unknown), or None (all unknown).
            visit_gap: ``(B, T)`` days since the previous visit and first-visit flags
                (:func:`~behrt_rope.model.visit_gap.days_since_previous_visit`); used with ``config.visit_gap``.

        Returns:
            ``(B, T, H)``.
        """
        # With the BERT initialisation (std 0.02 everywhere) the age term, a projection of k + 1 unit-scale
        # Time2Vec features, would start ~4x larger than the code: scaled, the code leads (see ModelConfig).
        x = self.code(token_ids) * self.code_scale + self.segment(segments.long()) + self.age(ages)  # (B, T, H)
        if self.sex is not None and sex is not None:
            x = x + self.sex(sex.long())  # (B, T, H)
        if self.visit_gap is not None:
            if visit_gap is None:
                raise ValueError("model.visit_gap needs the days since the previous visit")
            x = x + self.visit_gap(*visit_gap)  # (B, T, H)
        if self.absolute:
            if positions is None:
                raise ValueError("position_encoding='absolute' needs positions")
            index = positions.round().long()  # (B, T); ages * rope_age_scale round to the nearest unit
            # A data-dependent check (a host sync on GPU), paid only by the ablation: an index outside the
            # table would otherwise be a device-side assert on GPU.
            n = self.position_table.shape[0]
            if bool((index < 0).any()) or bool((index >= n).any()):
                raise ValueError(f"absolute position encoding needs positions in [0, max_positions={n})")
            x = x + F.embedding(index, self.position_table)  # (B, T, H)
        return self.drop(self.norm(x))
