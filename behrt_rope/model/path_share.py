"""A path fitted apart from the deep part, and its share of the model's logit."""

from __future__ import annotations

import torch
from torch import nn


class SharedPath(nn.Module):
    """Base of the paths ``finetune`` fits apart from the deep part and mixes in: ``share`` ``()`` float32, a
    buffer saved with the model, is the path's weight in the model's logit (the rest goes to what it is mixed
    with); ``finetune`` chooses it on the tuning split."""

    share: torch.Tensor  # () float32
    path_name = "path"
    """What error messages call the path."""

    def __init__(self, share: float) -> None:
        super().__init__()
        self.register_buffer("share", torch.tensor(float(share)))

    def set_share(self, share: float) -> None:
        """The path's share of the model's logit, in [0, 1]."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the {self.path_name}'s share must lie in [0, 1], got {share}")
        self.share.fill_(share)
