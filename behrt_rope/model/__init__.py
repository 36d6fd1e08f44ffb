"""BEHRT with rotary position embedding: the encoder, its building blocks and its task heads (torch only)."""

from behrt_rope.model.attention import SelfAttention, key_padding_mask
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.embeddings import BehrtEmbeddings
from behrt_rope.model.encoder import BehrtEncoder, Block, FeedForward, init_weights, positions_for
from behrt_rope.model.heads import (
    IGNORE_INDEX,
    BehrtForMaskedLM,
    BehrtForMultiLabel,
    MaskedLMOutput,
    load_encoder_weights,
    multilabel_loss,
    pos_weight_from_counts,
)
from behrt_rope.model.rope import apply_rope, rope_angles, rope_frequencies, rotate_pairs, sinusoidal_table
from behrt_rope.model.time2vec import Time2Vec

__all__ = [
    "IGNORE_INDEX",
    "BehrtEmbeddings",
    "BehrtEncoder",
    "BehrtForMaskedLM",
    "BehrtForMultiLabel",
    "Block",
    "FeedForward",
    "MaskedLMOutput",
    "ModelConfig",
    "SelfAttention",
    "Time2Vec",
    "apply_rope",
    "init_weights",
    "key_padding_mask",
    "load_encoder_weights",
    "multilabel_loss",
    "pos_weight_from_counts",
    "positions_for",
    "rope_angles",
    "rope_frequencies",
    "rotate_pairs",
    "sinusoidal_table",
]
