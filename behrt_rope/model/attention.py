"""Multi-head self-attention with rotary position embedding, on ``scaled_dot_product_attention``."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.rope import rotate

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA backends allowed on CUDA: all but cuDNN's. cuDNN builds an execution plan for every new input shape
(about 50 ms for a forward, 130 ms for a training step of the default model on an H200), and length-bucketed
batches bring a new length almost every step: with it a training step took 130-160 ms instead of 10-47 ms
(docs/benchmarks.md, "Training on a GPU")."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``(B, nh, T, d)`` queries, keys and values; on CUDA without the
    cuDNN backend (:data:`CUDA_SDPA_BACKENDS`), elsewhere as torch chooses."""
    with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Turn a ``(B, T)`` bool "real token" mask into SDPA's ``(B, 1, 1, T)`` key mask, or ``None``.

    ``None`` comes back when nothing is padded (or no mask was given): an explicit mask rules out the flash
    backend on GPU, and costs a masked add on CPU, for nothing. Finding that out reads the mask on the host:
    one device sync per forward on GPU (not measured here against the cost of always passing the mask).

    A query whose keys are all masked gets a softmax over nothing: NaN. Real queries always see themselves,
    and padding queries see their row's real tokens, so only a row made entirely of padding can hit it. For
    such a row key 0 is unmasked, so that its (meaningless, never used) outputs stay finite and no NaN reaches
    the gradients of the weights.

    >>> m = torch.tensor([[True, True, False], [False, False, False]])
    >>> key_padding_mask(m)[:, 0, 0].tolist()
    [[True, True, False], [True, False, False]]
    >>> key_padding_mask(torch.ones(2, 3, dtype=torch.bool)) is None
    True
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    mask = attention_mask.bool().clone()  # (B, T)
    mask[:, 0] |= ~mask.any(dim=-1)  # all-padding rows may attend to key 0: no all-masked softmax, no NaN
    return mask[:, None, None, :]  # (B, 1, 1, T): broadcast over heads and queries


def visit_causal_mask(visit_index: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, 1, T, T)`` bool: query ``i`` may attend to key ``j`` iff ``j`` is real and
    ``visit(j) <= visit(i)``.

    Every token sees its own visit and earlier ones, never later ones. The state of visit ``k``'s [SEP] is
    then exactly what the encoder computes from visits ``0..k`` alone, so one pass over a patient gives a
    leakage-free prediction after every visit. [CLS] belongs to visit 0, so every query (padding included,
    whose visit index is 0) has at least one key: no all-masked row, no NaN.

    >>> visit_causal_mask(torch.tensor([[0, 0, 1, 1]]), None)[0, 0].int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    """
    allowed = visit_index[:, None, :] <= visit_index[:, :, None]  # (B, T_query, T_key)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    return allowed[:, None]  # (B, 1, T, T): broadcast over heads


def _qk_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables laid out to broadcast against the ``(B, T, 2, nh, d)`` query|key slice of the projection.

    ``(B, T, d/2)`` tables (shared by the heads) become ``(B, T, 1, 1, d/2)``; ``(B, nh, T, d/2)`` tables (one
    per head) become ``(B, T, 1, nh, d/2)``. Views only.
    """
    if cos.dim() == 3:
        return cos[:, :, None, None], sin[:, :, None, None]  # (B, T, 1, 1, d/2)
    return cos.transpose(1, 2)[:, :, None], sin.transpose(1, 2)[:, :, None]  # (B, T, 1, nh, d/2)


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention; RoPE rotates queries and keys when tables are given."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        # q, k and v of all heads in one matmul
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            x: ``(B, T, H)`` hidden states.
            cos, sin: ``(B, T, d/2)`` RoPE tables from ``rope_angles`` (or ``(B, nh, T, d/2)`` from
                ``per_head_angles``), or ``None`` (no rotation: the absolute ablation).
            attn_mask: ``(B, 1, 1, T)`` or ``(B, 1, T, T)`` bool, True where a key may be attended to (see
                :func:`key_padding_mask` and :func:`visit_causal_mask`), or ``None`` for no padding.

        Returns:
            ``(B, T, H)``.
        """
        B, T, C = x.shape
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # (B, T, 3, nh, d)
        qk, v = qkv[:, :, :2], qkv[:, :, 2]  # (B, T, 2, nh, d), (B, T, nh, d): views, no copies
        if cos is not None and sin is not None:
            qk = rotate(qk, *_qk_tables(cos, sin))  # queries and keys in one op
        q, k = qk.transpose(1, 3).unbind(2)  # 2 x (B, nh, T, d)
        v = v.transpose(1, 2)  # (B, nh, T, d)
        # Dropout on the attention weights only while training: any p > 0 sends CPU to the slow math path.
        dropout_p = self.attention_dropout if self.training else 0.0
        y = attend(q, k, v, attn_mask, dropout_p)  # (B, nh, T, d)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, H): heads side by side again
        return self.resid_drop(self.proj(y))
