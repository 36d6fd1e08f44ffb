"""BEHRT's masked-code pre-training objective: which tokens to hide, and what to put in their place.

The published scheme (BERT's, which BEHRT adopted): each eligible token is chosen with probability 0.15; a
chosen token becomes ``[MASK]`` with probability 0.8, a random code with probability 0.1, and stays unchanged
with probability 0.1; the loss is taken at every chosen token. Overall, of the eligible tokens: 12% masked,
1.5% replaced, 1.5% unchanged but predicted, 85% not chosen (of the chosen: 80/10/10).

Departures from BEHRT's released code, which deviated from its paper (details in docs/model.md):

- Only real codes are eligible (id >= ``N_SPECIAL``): ``[PAD]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` and
  ``[UNK]`` are never chosen (the released code could choose ``[CLS]``, ``[SEP]`` and friends).
- The "unchanged" tokens are kept in place with their label, so they count in the loss and every later token
  stays aligned with its own label (the released code's "unchanged" branch lost those tokens from the loss
  and shifted the rest of the sequence against its labels).
- Random replacements come from the real codes only, not from the whole vocabulary.

A random replacement is drawn uniformly from the real codes ``[N_SPECIAL, vocab_size)``, so it may equal the
original code (probability ``1 / (vocab_size - N_SPECIAL)``), as in BERT.
"""

from __future__ import annotations

import torch

from behrt_rope.schema import MASK_ID, N_SPECIAL

IGNORE_INDEX = -100
"""Label of the tokens that are not chosen (PyTorch's ``cross_entropy`` default ``ignore_index``)."""


def mask_tokens(
    token_ids: torch.Tensor,
    vocab_size: int,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    mask_token_frac: float = 0.8,
    random_token_frac: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose tokens to predict and corrupt them, BERT/BEHRT style.

    Args:
        token_ids: ``(B, T)`` (any shape) integer ids; not modified.
        vocab_size: number of ids, special tokens included; random codes are drawn from
            ``[N_SPECIAL, vocab_size)``.
        generator: the only source of randomness, so a seeded generator gives the same result every time. The
            draws happen on the generator's device and move to ``token_ids``'s device.
        mask_prob: probability that an eligible (non-special) token is chosen.
        mask_token_frac: share of the chosen tokens replaced by ``[MASK]``.
        random_token_frac: share of the chosen tokens replaced by a random real code; the remaining
            ``1 - mask_token_frac - random_token_frac`` are left unchanged.

    Returns:
        ``(input_ids, labels)``: ``input_ids`` like ``token_ids`` (same dtype) with the chosen tokens
        corrupted; ``labels`` long, the original id at the chosen tokens and ``-100`` elsewhere.

    >>> ids = torch.tensor([[1, 5, 6, 7, 2, 0]])
    >>> gen = torch.Generator().manual_seed(0)
    >>> inputs, labels = mask_tokens(ids, vocab_size=8, generator=gen, mask_prob=1.0)
    >>> labels.tolist()  # every real code chosen; [CLS], [SEP] and [PAD] never
    [[-100, 5, 6, 7, -100, -100]]
    """
    if vocab_size <= N_SPECIAL:
        raise ValueError(f"vocab_size {vocab_size} leaves no real code (ids below {N_SPECIAL} are special)")
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must lie in [0, 1], got {mask_prob}")
    if mask_token_frac < 0 or random_token_frac < 0 or mask_token_frac + random_token_frac > 1.0:
        raise ValueError("mask_token_frac and random_token_frac must be >= 0 and sum to at most 1")

    shape, device = token_ids.shape, token_ids.device

    def uniform() -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=generator.device).to(device)

    eligible = token_ids >= N_SPECIAL  # special ids are never chosen
    chosen = eligible & (uniform() < mask_prob)
    u = uniform()  # one draw decides mask / random / unchanged for every chosen token
    to_mask = chosen & (u < mask_token_frac)
    to_random = chosen & (u >= mask_token_frac) & (u < mask_token_frac + random_token_frac)
    random_ids = torch.randint(N_SPECIAL, vocab_size, shape, generator=generator, device=generator.device)

    input_ids = token_ids.clone()  # never touch the caller's tensor
    input_ids[to_mask] = MASK_ID
    input_ids[to_random] = random_ids.to(device=device, dtype=token_ids.dtype)[to_random]
    labels = torch.where(chosen, token_ids.long(), torch.full_like(token_ids, IGNORE_INDEX, dtype=torch.long))
    return input_ids, labels
