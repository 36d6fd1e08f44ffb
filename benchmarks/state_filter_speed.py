"""The hidden-state filter's step cost: its transition table against a matrix exponential at every visit.

    python benchmarks/state_filter_speed.py [--patients 32] [--visits 30] [--codes 3] [--labels 64]
                                            [--states 4] [--chains 45] [--repeat 5] [--threads 1]

Builds a random batch (``--patients`` rows of ``--visits`` visits with ``--codes`` codes each, gaps of 0.5
years plus up to 10 years of age spread) and times one forward and backward pass of
:class:`behrt_rope.model.state_filter.HiddenStateFilter` (``model.state_filter``):

* ``table`` (ours): the transition matrices read bilinearly off one small table per pass (ages every 10 years,
  both sexes, gaps 0 and 2^j / 64 years by exact squaring);
* ``per_visit_matrix_exp`` (baseline): the obvious implementation, ``expm(Q(age, sex) gap)`` for every
  (patient, label) at every visit.

The two are different functions (the table interpolates between its grid points), so their logits are not
compared; the test suite checks the table against a written-out filter. Then, what the filter adds to a
fine-tuning step: forward + backward of the deep part of :class:`behrt_rope.model.heads.BehrtForMultiLabel`
with the DEFAULT :class:`~behrt_rope.model.config.ModelConfig` against the same with ``state_filter =
--states``, scored at every visit. And what sharing chains saves (the state path's default since session 52):
labels that share chains (``--chains`` chains for ``--labels`` labels, 45 for 64 as on a progression draw) run
only the chains some label reads, against the session-51 filter that ran a chain per label whatever it shared.
Prints one JSON object: best-of-``--repeat`` seconds of each, the speed-ups and the share the filter adds to a
model step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.schema import N_SPECIAL, SEP_ID


class PerVisitMatrixExp(HiddenStateFilter):
    """The baseline: one matrix exponential per (patient, label) at every visit; the table is never used."""

    def transition_table(self) -> torch.Tensor:
        return torch.empty(0)

    def _transitions(self, at_visit: torch.Tensor, female: torch.Tensor) -> torch.Tensor:
        B, V = at_visit.shape
        age = at_visit[:, :-1].reshape(-1)
        gap = (at_visit[:, 1:] - at_visit[:, :-1]).clamp(min=0.0).reshape(-1)
        sex = female[:, None].expand(B, V - 1).reshape(-1)
        transition = torch.linalg.matrix_exp(self.generator(age, sex) * gap[:, None, None, None])
        return transition.view(B, V - 1, *transition.shape[1:])


def random_batch(patients: int, visits: int, codes: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``(B, visits x (codes + 1))`` token ids ending each visit with [SEP], visit numbers, ages, sex ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(N_SPECIAL, vocab, (patients, visits, codes + 1), generator=g)
    ids[:, :, -1] = SEP_ID
    token_ids = ids.flatten(1)
    visit = torch.arange(visits).repeat_interleave(codes + 1)[None].expand(patients, -1).contiguous()
    ages = 40.0 + 0.5 * visit.float() + 10.0 * torch.rand(patients, 1, generator=g)
    sex = torch.randint(1, 3, (patients, 1), generator=g).expand_as(token_ids).contiguous()
    return {"token_ids": token_ids, "visit_index": visit, "ages": ages, "score_at": token_ids == SEP_ID, "sex": sex}


def best_seconds(module: HiddenStateFilter, batch: dict[str, torch.Tensor], repeat: int, backward: bool) -> float:
    """Best wall seconds of ``repeat`` passes (after one warm-up)."""
    times = []
    for _ in range(repeat + 1):
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = module(**batch)
        if backward:
            logits.sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def model_step_seconds(states: int, batch: dict[str, torch.Tensor], vocab: int, labels: int, repeat: int) -> float:
    """Best seconds of the deep part's forward + backward with the default config and ``state_filter=states``."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, state_filter=states)
    model = BehrtForMultiLabel(config, labels, "visit", list(range(N_SPECIAL, N_SPECIAL + labels)))
    inputs = {**batch, "segments": batch["visit_index"] % 2}
    times = []
    for _ in range(repeat + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.deep_logits(**inputs).sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def shared_chain_seconds(args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Forward + backward seconds of ``--labels`` labels on ``--chains`` chains: every chain run (a chain per
    label, the session-51 filter's cost) against only the chains read."""
    chain_of_label = torch.arange(args.labels) % args.chains  # labels beyond --chains share the first chains
    seconds = {}
    for name, drop_unread in (("chain_per_label_s", False), ("chains_read_s", True)):
        torch.manual_seed(0)
        module = HiddenStateFilter(args.vocab, args.labels, args.states)
        if drop_unread:
            module.share_chains(chain_of_label)
        else:
            module.chain_of_label.copy_(chain_of_label)  # the labels share, every chain still runs
        seconds[name] = round(best_seconds(module, batch, args.repeat, backward=True), 4)
    seconds["speed_up"] = round(seconds["chain_per_label_s"] / seconds["chains_read_s"], 2)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=32)
    parser.add_argument("--visits", type=int, default=30)
    parser.add_argument("--codes", type=int, default=3)
    parser.add_argument("--labels", type=int, default=64)
    parser.add_argument("--states", type=int, default=4)
    parser.add_argument("--chains", type=int, default=45)
    parser.add_argument("--vocab", type=int, default=80)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = random_batch(args.patients, args.visits, args.codes, args.vocab)
    result: dict[str, object] = {"settings": vars(args), "torch": torch.__version__}
    for name, cls in (("table", HiddenStateFilter), ("per_visit_matrix_exp", PerVisitMatrixExp)):
        torch.manual_seed(0)
        module = cls(args.vocab, args.labels, args.states)
        result[name] = {
            "forward_s": round(best_seconds(module, batch, args.repeat, backward=False), 4),
            "forward_backward_s": round(best_seconds(module, batch, args.repeat, backward=True), 4),
        }
    ours, baseline = result["table"], result["per_visit_matrix_exp"]
    assert isinstance(ours, dict) and isinstance(baseline, dict)
    result["speed_up_forward_backward"] = round(baseline["forward_backward_s"] / ours["forward_backward_s"], 2)
    result["shared_chains"] = shared_chain_seconds(args, batch)
    if args.vocab - N_SPECIAL >= args.labels:
        plain = model_step_seconds(0, batch, args.vocab, args.labels, args.repeat)
        with_filter = model_step_seconds(args.states, batch, args.vocab, args.labels, args.repeat)
        result["model_step_s"] = {"default": round(plain, 4), "with_state_filter": round(with_filter, 4)}
        result["filter_adds_to_a_model_step"] = round(with_filter / plain - 1.0, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
