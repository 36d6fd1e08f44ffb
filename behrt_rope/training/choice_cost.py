"""What fine-tuning's choices after training will cost, measured before training so the time budget holds it back.

After the deep part's training, fine-tuning chooses the paths' shares (and, with several distillation weights,
the run to keep) on the tuning split, each candidate scored by its macro AP and 200 paired bootstrap replicates
over the tuning patients (``training/clear_gain.py``). That work grows with the tuning split's samples x labels
and with the host's speed at numpy's ranking, not with the model's forward pass, so a reserve of validation
epochs alone fitted one cohort and fell short on another: on a slower host a budget-bound fine-tuning ended 30-60 s
past its budget (docs/benchmarks.md, "Seventy-fourth round"). :func:`choice_seconds` times one candidate's scoring
on the tuning split's own shape and multiplies it by the number of candidates the run will score.
"""

from __future__ import annotations

import time

import numpy as np

from behrt_rope.training.clear_gain import ScoredCandidates


def choice_seconds(y: np.ndarray, patients: np.ndarray, candidates: int, seed: int = 0) -> float:
    """Seconds that scoring ``candidates`` candidates on the tuning split (``y`` its ``(N, L)`` targets,
    ``patients`` ``(N,)`` each sample's patient) will take: one candidate (random scores: a ranking costs the same
    whatever its order) timed here, times ``candidates``; 0 for none or without samples."""
    if candidates <= 0 or len(y) == 0:
        return 0.0
    probs = np.random.default_rng(seed).random(y.shape)
    started = time.perf_counter()
    ScoredCandidates.score(y, {0.0: probs}, patients)
    return candidates * (time.perf_counter() - started)
