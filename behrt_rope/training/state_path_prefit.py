"""Start the state path's chains from a hidden Markov model of their own codes' record.

The chains' fit (``state_path_fit.py``) trains each chain by the next-visit loss of its labels alone: a chain
learns its stages only from what they say about the *next* visit. The same chain is also a model of the whole
record of its codes: read as a hidden Markov model whose states record each of its label codes with their own
chance (:meth:`~behrt_rope.model.state_filter.HiddenStateFilter.code_log_likelihood`), every visit of every
train patient, present codes and absent ones, is evidence about its moves and stages. This module fits that
model by maximum likelihood (Adam, the forward algorithm's log-likelihood per visit) and hands it to the
discriminative fit as its start (:meth:`~behrt_rope.model.state_filter.HiddenStateFilter.adopt_emissions`): each
code's evidence on its chain is then the log-odds its fitted chances give, codes of other labels keep their
small random start until the discriminative fit (under its L1 penalty) finds a use for them, and each label's
chance at the next visit starts at its code's chance at this one. A classic pairing: a generative start, then
discriminative training of the same parameters.

On two screening cohorts' tuning splits (3,573 and 3,273 patients), one set of chains alone, five seeds each:
progression 0.1297 macro AP on average from this start against 0.1287 from a random one, recurrence_sparse
0.2883 against 0.2875, each seed's best epoch reached in 6-19 epochs instead of 15-39 (docs/benchmarks.md,
"Sixty-second round").
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from behrt_rope.data.batching import BucketBatchSampler
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.training.loaders import SplitData

log = logging.getLogger("behrt_rope.finetune")

PREFIT_EPOCHS = 40
"""Default epochs at most of the generative start (``finetune`` ``state_path_prefit_epochs``; 0: none)."""
LEARNING_RATE = 0.03
"""Adam's step size (patients per step: ``BATCH_PATIENTS``)."""
BATCH_PATIENTS = 256
"""Patients per step; each brings every visit of its history."""
TOLERANCE = 6e-5
"""Nats per visit per step: the fit stops once an epoch lowers the mean negative log-likelihood by less than
this times its steps (about 1e-3 an epoch on 4,000 train patients)."""
START_LOG_ODDS = (-3.0, -3.0)
"""The codes' log-odds of being recorded start on a ladder over the states, from the first to the last (here
flat: about 5% a visit in every state), plus noise of sd :data:`START_SPREAD` per code and state, so that the
states can take different roles. Chosen on two screening cohorts' tuning splits (one set of chains alone, five
seeds each; docs/benchmarks.md, "Sixty-second round"): this start scored +0.0010 (progression) and +0.0009
(recurrence_sparse) macro AP above the random start without the fit, a ladder from -5 to 0 with the same noise
+0.0009 and -0.0000 (three seeds). On a toy cohort whose two codes share one state the flat start stalls in a
state per code on two seeds of three, the ladder on none (tests/test_state_path_prefit.py)."""
START_SPREAD = 1.5


def emitted_codes(chains: HiddenStateFilter, label_token_ids: torch.Tensor) -> torch.Tensor:
    """``(G, J)`` long: the label codes each chain reads (``label_token_ids`` ``(L,)``, -1 for none), in label
    order, -1 in the slots a chain with fewer than ``J`` labels leaves free."""
    chain_of_label = chains.chain_of_label.cpu()
    label_token_ids = label_token_ids.cpu()
    known = label_token_ids >= 0
    per_chain: list[list[int]] = [[] for _ in range(chains.num_chains)]
    for chain, code in zip(chain_of_label[known].tolist(), label_token_ids[known].tolist(), strict=True):
        per_chain[chain].append(code)
    width = max((len(c) for c in per_chain), default=0) or 1
    codes = torch.full((chains.num_chains, width), -1, dtype=torch.long)
    for chain, listed in enumerate(per_chain):
        codes[chain, : len(listed)] = torch.tensor(listed, dtype=torch.long)
    return codes.to(chains.chain_of_label.device)


def prefit_chains(
    chains: HiddenStateFilter,
    label_token_ids: torch.Tensor,
    train: SplitData,
    max_epochs: int = PREFIT_EPOCHS,
    seed: int = 0,
    deadline: float | None = None,
    device: torch.device | None = None,
    start_log_odds: tuple[float, float] = START_LOG_ODDS,
    start_spread: float = START_SPREAD,
    name: str = "state path's chains",
) -> dict[str, Any]:
    """Fit ``chains`` as hidden Markov models of their label codes on the train split by maximum likelihood, then
    make that model their start (:meth:`HiddenStateFilter.adopt_emissions`). Stops at ``max_epochs``, once an
    epoch gains less than :data:`TOLERANCE` a step, or before an epoch that would end past ``deadline``
    (``time.monotonic()``). The codes' log-odds start on a ladder over the states from ``start_log_odds[0]`` to
    ``start_log_odds[1]`` plus noise of sd ``start_spread``. Returns the epochs run and the last mean negative
    log-likelihood per visit. ``name`` says which chains in the log (e.g. ``"state path set 1's chains"``)."""
    device = device or torch.device("cpu")
    chains.to(device).train()
    codes = emitted_codes(chains, label_token_ids)
    generator = torch.Generator().manual_seed(seed)
    ladder = torch.linspace(*start_log_odds, chains.num_states)  # (K,)
    start = ladder + start_spread * torch.randn(*codes.shape, chains.num_states, generator=generator)
    log_odds = nn.Parameter(start.to(device))
    moves_and_start = [chains.rate, chains.rate_age, chains.rate_sex, chains.prior]
    optimizer = torch.optim.Adam([*moves_and_start, log_odds], lr=LEARNING_RATE)
    sampler = BucketBatchSampler(train.dataset.lengths, BATCH_PATIENTS, len(train.dataset.lengths), seed=seed)  # type: ignore[attr-defined]
    started, previous, nll, epochs, stopped_by = time.monotonic(), float("inf"), 0.0, 0, "max_epochs"
    for epoch in range(max_epochs):
        epoch_seconds = (time.monotonic() - started) / epoch if epoch else 0.0
        if deadline is not None and time.monotonic() + epoch_seconds > deadline:
            stopped_by = "the time budget (trainer.max_minutes)"
            break
        sampler.set_epoch(epoch)
        total, visits, steps = 0.0, 0.0, 0
        for items in sampler.batches():
            batch = train.collate([train.dataset[int(i)] for i in items])
            batch = {k: v.to(device) for k, v in batch.items()}
            loglik, seen = chains.code_log_likelihood(
                batch["token_ids"], batch["visit_index"], batch["ages"], codes, log_odds, batch.get("sex")
            )
            loss = -loglik / seen.clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, visits, steps = total - float(loglik.detach()), visits + float(seen), steps + 1
        nll, epochs = total / max(visits, 1.0), epoch + 1
        if previous - nll < TOLERANCE * steps:
            stopped_by = f"an epoch's gain under {TOLERANCE} nats per visit a step"
            break
        previous = nll
    if not epochs:
        log.info("finetune: %s start at random: %s left no time for their codes' record", name, stopped_by)
        return {"epochs": 0, "nll_per_visit": None, "stopped_by": stopped_by}
    chains.adopt_emissions(codes, log_odds.detach(), label_token_ids.to(device))
    log.info("finetune: %s started from their codes' record: %d epochs, %.4f nats a visit", name, epochs, nll)
    return {"epochs": epochs, "nll_per_visit": round(nll, 5), "stopped_by": stopped_by}
