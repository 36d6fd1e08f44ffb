"""Per-label head parameters drawn partly from each label's own code embedding (label-code tying).

A label of the fine-tuning head *is* a code of the vocabulary, and MLM pre-training has already learned an
embedding for it: with the MLM decoder tied to the code embedding, ``E_c`` is what a context must look like
for ``c`` to be the masked code, which is close to what a history must look like for ``c`` to come next.
A head whose per-label parameters are all free learns each label from that label's positives alone; a rare
code has a few dozen and its parameters stay near their initialisation. Here each per-label parameter is

    theta_l = free_l + W e_l + b,    e_l = LayerNorm(E[code of l]) / sqrt(H)  (unit length)

with ``W`` and ``b`` shared by all labels and zero at initialisation (the head starts as the untied one).
``b`` is what every label has in common (a code already on file predicts itself); ``W e_l`` lets labels
with similar codes share what they learn; ``free_l`` keeps what is specific to one label. The same idea as
tying output to input embeddings in language models (Press and Wolf 2017) and as label embeddings in
multi-label text classification, applied to every per-label parameter of the head.

Shapes: ``L`` labels, ``H`` hidden size, ``V`` vocabulary size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def label_vectors(code_embedding: torch.Tensor, label_token_ids: torch.Tensor) -> torch.Tensor:
    """``(L, H)`` unit-length vectors of the label codes: the rows of ``code_embedding`` ``(V, H)`` at
    ``label_token_ids`` ``(L,)``, layer-normalised (no affine) and divided by ``sqrt(H)``.

    The normalisation keeps the shared maps' effective learning rate independent of how large pre-training
    left the embedding.
    """
    rows = code_embedding[label_token_ids.clamp(min=0)].float()  # (L, H)
    hidden = rows.shape[-1]
    return F.layer_norm(rows, (hidden,)) / math.sqrt(hidden)


class LabelCodeMaps(nn.Module):
    """Shared maps from a label's code vector to offsets of its per-label parameters, one per named part.

    ``sizes`` names each part and its width per label; :meth:`forward` returns ``{name: (L, size)}``. The
    parts are one linear layer split by columns, which starts at zero, so a tied head starts exactly as the
    untied one.
    """

    def __init__(self, hidden_size: int, sizes: dict[str, int]) -> None:
        super().__init__()
        self.sizes = dict(sizes)
        self.map = nn.Linear(hidden_size, sum(self.sizes.values()))
        nn.init.zeros_(self.map.weight)
        nn.init.zeros_(self.map.bias)

    def forward(self, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        """``vectors`` ``(L, H)`` from :func:`label_vectors` -> ``{name: (L, size)}`` offsets."""
        parts = self.map(vectors.to(self.map.weight.dtype)).split(list(self.sizes.values()), dim=-1)
        return dict(zip(self.sizes, parts, strict=True))
