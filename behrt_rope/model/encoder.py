"""The BEHRT encoder: embeddings, then a stack of pre-LN transformer blocks with rotary attention.

Block layout: pre-LN (``x + attn(ln(x))``, ``x + mlp(ln(x))``) with a final LayerNorm, rather than BERT's and
BEHRT's post-LN. Pre-LN keeps an identity path from the embeddings to the output, so gradients reach the early
layers at their full size and training is stable without a long learning-rate warm-up (Xiong et al. 2020, "On
Layer Normalization in the Transformer Architecture"); the final LayerNorm normalises the residual stream the
heads read.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from behrt_rope.model.attention import SelfAttention, key_padding_mask, visit_causal_mask
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.embeddings import BehrtEmbeddings
from behrt_rope.model.rope import per_head_angles, rope_angles
from behrt_rope.model.visit_gap import DAYS_PER_YEAR, days_since_previous_visit
from behrt_rope.schema import PAD_ID

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of linear and embedding weights, as in BERT."""


def positions_for(config: ModelConfig, visit_index: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
    """Each token's position, ``(B, T)`` float32, according to ``config.position_source``.

    - ``"visit"`` (default): the visit index. All codes of one visit share a position (and age and segment),
      so attention cannot tell their order apart: the output is invariant to shuffling codes inside a visit,
      which carry no order in the record.
    - ``"token"``: the index in the token stream, ``0 .. T-1`` (the NLP convention).
    - ``"age"``: the age in years times ``config.rope_age_scale`` (e.g. 12: months), so rotation angles follow
      elapsed time rather than visit counts.

    >>> cfg = ModelConfig(vocab_size=10, position_source="token")
    >>> positions_for(cfg, torch.tensor([[0, 0, 1]]), torch.zeros(1, 3)).tolist()
    [[0.0, 1.0, 2.0]]
    """
    if config.position_source == "visit":
        return visit_index.float()  # (B, T)
    if config.position_source == "token":
        B, T = visit_index.shape
        return torch.arange(T, device=visit_index.device, dtype=torch.float32).expand(B, T)  # (B, T)
    if config.position_source == "age":
        return ages.float() * config.rope_age_scale  # (B, T)
    raise ValueError(f"unknown position_source {config.position_source!r}")


def rope_tables(
    config: ModelConfig,
    positions: torch.Tensor,
    ages: torch.Tensor,
    num_heads: int,
    age_heads: int,
    head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``num_heads`` heads of size ``head_dim`` (default ``hidden_size / num_heads``):
    ``(B, T, d/2)`` shared when every head rotates by ``positions``, else ``(B, num_heads, T, d/2)`` with the
    last ``age_heads`` heads rotating by the age in days.

    Age in days gives angles ``days * theta_i``: with the default base the periods run from about 6 days to
    about a century, so a head can weigh a code by how long ago it was recorded, at any time scale.
    """
    head_dim = head_dim or config.hidden_size // num_heads
    if age_heads == 0:
        return rope_angles(positions, head_dim, config.rope_base)
    days = ages.float() * DAYS_PER_YEAR  # (B, T)
    return per_head_angles([(positions, num_heads - age_heads), (days, age_heads)], head_dim, config.rope_base)


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``H -> intermediate_size -> H`` with GELU, as in BERT."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, H) -> (B, T, H)``."""
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, H)`` -> ``(B, T, H)``.

        ``cos``/``sin``: ``(B, T, d/2)`` or ``(B, nh, T, d/2)`` or None; ``attn_mask``: ``(B, 1, 1, T)`` or None.
        """
        x = x + self.attn(self.ln1(x), cos, sin, attn_mask)
        return x + self.mlp(self.ln2(x))


def init_weights(module: nn.Module) -> None:
    """BERT initialisation, for ``Module.apply``: normal(0, 0.02) weights, zero biases, unit LayerNorms.

    The padding row of an embedding is zeroed again afterwards, so ``[PAD]`` embeds to zero.
    """
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class BehrtEncoder(nn.Module):
    """Token ids, ages, segments and visit indices of a batch of patients -> contextual token states."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_heads
        self.embeddings = BehrtEmbeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # pre-LN needs a final norm
        self.apply(init_weights)
        if config.scale_code_embedding:  # Time2Vec's projection at the scale of one input feature
            with torch.no_grad():
                self.embeddings.age.proj.weight.div_(math.sqrt(config.time2vec_periodic + 1))
        if self.embeddings.visit_gap is not None:
            self.embeddings.visit_gap.reset_to_zero()

    def forward(
        self,
        token_ids: torch.Tensor,
        ages: torch.Tensor,
        segments: torch.Tensor,
        visit_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        visit_causal: bool = False,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode one batch.

        Args:
            token_ids: ``(B, T)`` long vocabulary ids (``[CLS]`` first, ``[PAD]`` = 0 after the end).
            ages: ``(B, T)`` float ages in years.
            segments: ``(B, T)`` long segment ids.
            visit_index: ``(B, T)`` long 0-based visit numbers.
            attention_mask: ``(B, T)`` bool, True at real tokens; ``None`` means ``token_ids != PAD_ID``.
            visit_causal: tokens attend only to their own and earlier visits (see ``visit_causal_mask``);
                otherwise attention is bidirectional over the real tokens.
            sex: ``(B, T)`` long sex ids (the patient's, on each token; 0 unknown), or None (all unknown).

        Returns:
            ``(B, T, H)`` hidden states after the final LayerNorm. Rows of padding positions are finite but
            meaningless.
        """
        if attention_mask is None:
            attention_mask = token_ids != PAD_ID
        positions = positions_for(self.config, visit_index, ages)  # (B, T) float32
        gap = days_since_previous_visit(ages, visit_index, attention_mask) if self.config.visit_gap else None
        x = self.embeddings(token_ids, ages, segments, positions, sex, gap)  # (B, T, H)
        cos = sin = None
        if self.config.position_encoding == "rope":
            # One pair of tables per forward, shared by every block.
            cos, sin = rope_tables(self.config, positions, ages, self.config.num_heads, self.config.age_heads)
        attn_mask = (
            visit_causal_mask(visit_index, attention_mask)  # (B, 1, T, T)
            if visit_causal
            else key_padding_mask(attention_mask)  # (B, 1, 1, T) or None
        )
        for block in self.blocks:
            x = block(x, cos, sin, attn_mask)
        return self.ln_f(x)
