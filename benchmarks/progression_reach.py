"""How much of the gap to the oracle can a learner told the progression process's structure close?

    python benchmarks/progression_reach.py --work W/progression [--max-iter 80]

``W/progression`` is a cohort folder of ``benchmarks/quality.py`` (its ``cohort``, ``etl`` and, when present,
``finetune`` and ``evaluate``); ``quality.py --reach`` runs the same fit inside the benchmark.

The progression oracle (``synthetic_data/progression.py``) is the forward filter of the generator's hidden
Markov model with its true parameters. This script *fits* that model on the records of the train split's
patients of the ETL in ``--etl`` (the same patients the model and the references train on) by maximum
likelihood, and predicts with the fitted model's filter at the oracle's cuts of the held-out patients.

Told: which codes form a pair, which is a symptom and which a diagnosis of which condition, the four stages
and the moves between them, the onset's form (log-linear in age and sex, ``exp(coupling)`` times faster while
the parent is established), that codes are recorded independently given the stages, and the next visit's
timing law (it depends on the record and the patient's visit rate only, as in the oracle). Learned: per
condition the onset, remission, progression, resolution and relapse rates, the age slope and sex effect, the
symptom and diagnosis code's chance in each stage, per pair the coupling (31 numbers a pair), and each
background code's chance. The fit starts from the middle of the ranges the generator draws from.

So the fitted filter differs from the oracle by its parameters only: the share of the gap it closes is what
4,000 patients let a learner that knows the structure reach, against which the model's share is read.

Prints JSON: macro AP at the cuts of the fitted filter, the oracle and the chain's law at each patient's age
(no record), the share of the gap from that law to the oracle the fit closes, the fit's log-likelihood per
visit against the true parameters', and ``per_code`` (each code's AP for the three), so that the macro average
can be taken over a fine-tuned model's labels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import average_precision_score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.sequences import load_tokens  # noqa: E402
from synthetic_data.generator import SynthConfig, patient_ids  # noqa: E402
from synthetic_data.progression import (  # noqa: E402
    CODES_PER_PAIR,
    JOINT,
    MAX_AGE_YEARS,
    STAGES,
    ProgressionCatalogue,
    ProgressionSimulation,
    _transition_tables,
    draw_catalogue,
    progression_oracle,
)

RATES = ("onset", "remit", "progress", "resolve", "relapse")
"""Each condition's yearly rates, in the order of :attr:`TorchChain.log_rates`."""
START = {"onset": 0.0063, "remit": 0.25, "progress": 0.28, "resolve": 0.35, "relapse": 0.15}
"""Where the fit starts: the middle of the generator's ranges (geometric for onset and progression)."""
START_CHANCES = {"symptom": (0.006, 0.35, 0.2, 0.012), "diagnosis": (0.002, 0.06, 0.6, 0.05)}
"""The same for the symptom and the diagnosis code's chance at a visit in each stage (none ... resolved)."""


@dataclass(frozen=True)
class Records:
    """Every recorded visit of a simulated progression cohort (``V`` visits, ``n`` patients, ``P`` pairs)."""

    patient: np.ndarray
    """``(V,)`` patient index of each visit, visits in the order they happened per patient."""
    month: np.ndarray
    """``(V,)`` window month of each visit (0-based)."""
    day: np.ndarray
    """``(V,)`` day of each visit (days since 1970-01-01)."""
    hits: np.ndarray
    """``(V, codes)`` bool: the codes each visit recorded."""
    female: np.ndarray
    """``(n,)`` bool."""
    age_month0: np.ndarray
    """``(n,)`` months from birth at the window's start."""
    months: int
    """Months in the window."""
    pairs: int


def collect_records(cfg: SynthConfig) -> Records:
    """Simulate ``cfg``'s cohort (the same draws as ``behrt-rope synth``) and keep what every visit recorded."""
    sim = ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    sim.run_visits(after_visit=lambda idx, day, hits, visit: parts.append((idx, day, hits)))
    patient = np.concatenate([p for p, _, _ in parts])
    day = np.concatenate([d for _, d, _ in parts])
    hits = np.concatenate([h for _, _, h in parts])
    order = np.argsort(patient, kind="stable")  # rounds are in time order, so each patient's visits stay in order
    return Records(
        patient[order],
        sim.month(day[order]),
        day[order],
        hits[order],
        sim.female,
        sim.age_month0,
        sim.months,
        sim.cat.pairs,
    )


class TorchChain(torch.nn.Module):
    """The progression model's parameters (``P`` pairs) in torch, and the transition matrices and code chances
    they imply (:func:`log_likelihood` scores records under them)."""

    def __init__(self, pairs: int) -> None:
        super().__init__()
        start = torch.log(torch.tensor([START[r] for r in RATES], dtype=torch.float64))
        self.log_rates = torch.nn.Parameter(start.expand(pairs, 2, len(RATES)).clone())  # (P, 2 conditions, 5)
        self.age_slope = torch.nn.Parameter(torch.full((pairs, 2), 0.5, dtype=torch.float64))
        self.sex = torch.nn.Parameter(torch.zeros(pairs, 2, dtype=torch.float64))
        self.coupling = torch.nn.Parameter(torch.full((pairs,), 1.75, dtype=torch.float64))
        chances = torch.tensor([START_CHANCES["symptom"], START_CHANCES["diagnosis"]], dtype=torch.float64)
        self.code_logit = torch.nn.Parameter(torch.logit(chances).expand(pairs, 2, 2, STAGES).clone())
        """``(P, 2 conditions, 2 codes (symptom, diagnosis), 4 stages)``."""

    def rates(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The fitted yearly rates, age slopes and sex effects ``(P, 2)`` each, and the couplings ``(P,)``, in
        the form ``synthetic_data.progression._transition_tables`` takes."""
        out = {r: self.log_rates[..., i].exp().detach().numpy() for i, r in enumerate(RATES)}
        out |= {"age_slope": self.age_slope.detach().numpy(), "sex": self.sex.detach().numpy()}
        return out, self.coupling.detach().numpy()

    def emission(self) -> torch.Tensor:
        """``(P, 16, 4)`` each pair code's chance by joint stage (the catalogue's ``emission``)."""
        chance = torch.sigmoid(self.code_logit)  # (P, 2, 2, 4)
        parent, child = np.divmod(np.arange(JOINT), STAGES)
        return torch.stack(
            [chance[:, 0, 0, parent], chance[:, 0, 1, parent], chance[:, 1, 0, child], chance[:, 1, 1, child]], dim=-1
        )

    def transitions(self) -> torch.Tensor:
        """``(P, 2 sexes, MAX_AGE_YEARS, 16, 16)`` monthly joint transition matrices (rows: from)."""
        years = torch.arange(MAX_AGE_YEARS, dtype=torch.float64) + 0.5
        female = torch.tensor([0.0, 1.0], dtype=torch.float64)
        rate = self.log_rates.exp()  # (P, 2, 5)
        log_onset = (
            self.log_rates[..., 0, None, None]
            + self.age_slope[..., None, None] * (years - 50.0) / 20.0
            + self.sex[..., None, None] * female[:, None]
        )  # (P, 2 conditions, 2 sexes, A)
        onset = log_onset.exp()
        parent = _monthly(onset[:, 0], rate[:, 0, None, None, 1:])  # (P, 2, A, 4, 4)
        faster = torch.ones(self.coupling.shape[0], STAGES, dtype=torch.float64)
        faster = torch.where(torch.arange(STAGES) == 2, self.coupling[:, None].exp(), faster)  # (P, 4 parent stages)
        child_onset = onset[:, 1, :, :, None] * faster[:, None, None, :]  # (P, 2, A, 4)
        child = _monthly(child_onset, rate[:, 1, None, None, None, 1:])  # (P, 2, A, 4, 4, 4)
        joint = torch.einsum("psaij,psaikl->psaikjl", parent, child)
        return joint.reshape(*joint.shape[:3], JOINT, JOINT)


def _monthly(onset: torch.Tensor, moves: torch.Tensor) -> torch.Tensor:
    """``(..., 4, 4)`` one month's transition matrices from yearly ``onset`` ``(...)`` and ``moves`` ``(..., 4)``
    (remit, progress, resolve, relapse; broadcast against ``onset``): ``synthetic_data.progression._monthly``."""
    moves = moves.expand(*onset.shape, 4)
    zero = torch.zeros_like(onset)
    remit, progress, resolve, relapse = moves.unbind(-1)
    generator = torch.stack(
        [
            torch.stack([-onset, onset, zero, zero], dim=-1),
            torch.stack([remit, -(remit + progress), progress, zero], dim=-1),
            torch.stack([zero, zero, -resolve, resolve], dim=-1),
            torch.stack([zero, zero, relapse, -relapse], dim=-1),
        ],
        dim=-2,
    )
    return torch.linalg.matrix_exp(generator / 12.0)


@dataclass(frozen=True)
class Batch:
    """Patients laid out ``(G, N)``: ``G`` groups of the same sex and whole years of age at the window's start
    (so each group's chain steps share one transition matrix a month, or the next year's), up to ``N`` a group."""

    sex: torch.Tensor
    """``(G,)`` 0 male, 1 female."""
    year0: torch.Tensor
    """``(G,)`` whole years of age at the window's start."""
    month_in_year: torch.Tensor
    """``(G, N)`` months past those whole years (0-11) of each slot's patient."""
    first: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """By window month: the slots whose first visit falls in it, their chain steps there and their sexes."""
    visits: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
    """By window month: the visits in it, in order (a patient's second visit in a month comes in the second
    entry): the slots and their pair codes' hits ``(V, P, 4)``."""

    @property
    def slots(self) -> int:
        return int(self.month_in_year.numel())


def make_batches(rec: Records, patients: np.ndarray, slots_per_batch: int = 1500) -> list[Batch]:
    """The patients ``patients`` (indices) of ``rec`` that have visits, in batches of about ``slots_per_batch``."""
    patients = np.intersect1d(patients, rec.patient)
    key = rec.female[patients].astype(np.int64) * 1000 + rec.age_month0[patients] // 12
    keys, group_of, sizes = np.unique(key, return_inverse=True, return_counts=True)
    order = np.argsort(sizes, kind="stable")  # similar sizes together: little padding
    batches, start = [], 0
    while start < len(order):
        n_max = sizes[order[start]]
        stop = start
        while stop < len(order) and (stop - start + 1) * max(n_max, sizes[order[stop]]) <= slots_per_batch:
            n_max, stop = max(n_max, sizes[order[stop]]), stop + 1
        stop = max(stop, start + 1)
        batches.append(_batch(rec, patients, keys, group_of, order[start:stop], int(sizes[order[start:stop]].max())))
        start = stop
    return batches


def _batch(
    rec: Records, patients: np.ndarray, keys: np.ndarray, group_of: np.ndarray, groups: np.ndarray, n: int
) -> Batch:
    """The batch of ``groups`` (indices into ``keys``, the groups of ``patients`` by ``group_of``), ``n`` slots a
    group; slot ``g n + i`` holds group ``g``'s ``i``-th patient, and the slots left over stay empty (a law of
    zeros, no visits)."""
    slot = np.full(len(rec.female), -1)
    for g, group in enumerate(groups):
        members = patients[group_of == group]
        slot[members] = g * n + np.arange(len(members))
    members = patients[slot[patients] >= 0]
    month_in_year = np.zeros(len(groups) * n, dtype=np.int64)
    month_in_year[slot[members]] = rec.age_month0[members] % 12
    chosen = slot[rec.patient] >= 0
    patient, month, hits = rec.patient[chosen], rec.month[chosen], rec.hits[chosen, : rec.pairs * CODES_PER_PAIR]
    run_start = np.r_[True, (patient[1:] != patient[:-1]) | (month[1:] != month[:-1])]
    rank = np.arange(len(patient)) - np.maximum.accumulate(np.where(run_start, np.arange(len(patient)), 0))
    is_first = np.r_[True, patient[1:] != patient[:-1]]
    first: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for m in np.unique(month[is_first]):
        who = patient[is_first & (month == m)]
        steps = rec.age_month0[who] + m
        first[int(m)] = (
            torch.as_tensor(slot[who]),
            torch.as_tensor(steps),
            torch.as_tensor(rec.female[who].astype(np.int64)),
        )
    visits: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for m, k in sorted(set(zip(month.tolist(), rank.tolist()))):
        at = (month == m) & (rank == k)
        pair_hits = torch.as_tensor(hits[at].reshape(-1, rec.pairs, CODES_PER_PAIR), dtype=torch.float32)
        visits.setdefault(int(m), []).append((torch.as_tensor(slot[patient[at]]), pair_hits))
    return Batch(
        torch.as_tensor(keys[groups] // 1000),
        torch.as_tensor(keys[groups] % 1000),
        torch.as_tensor(month_in_year.reshape(len(groups), n)),
        first,
        visits,
    )


def prior_table(transitions: torch.Tensor, steps: int) -> torch.Tensor:
    """``(P, 2, steps, 16)`` each pair's joint-stage law by sex and months since birth in stage 0."""
    law = torch.zeros(*transitions.shape[:2], JOINT, dtype=transitions.dtype)
    law[..., 0] = 1.0
    out = [law]
    for k in range(1, steps):
        law = torch.einsum("psi,psij->psj", law, transitions[:, :, min((k - 1) // 12, MAX_AGE_YEARS - 1)])
        out.append(law)
    return torch.stack(out, dim=2)


def log_likelihood(
    transitions: torch.Tensor, prior: torch.Tensor, emission: torch.Tensor, batch: Batch
) -> torch.Tensor:
    """The log-likelihood of the batch's records (its pair codes; sum over visits) under a model with these
    ``(P, 2, A, 16, 16)`` monthly ``transitions``, ``(P, 2, steps, 16)`` ``prior`` laws and ``(P, 16, 4)``
    ``emission``: the forward filter of ``synthetic_data.progression.StageFilter``, run month by month."""
    groups, n = batch.month_in_year.shape
    pairs = emission.shape[0]
    log_e, log_not = emission.log(), torch.log1p(-emission)
    law = torch.zeros(batch.slots, pairs, JOINT, dtype=transitions.dtype)
    total = torch.zeros((), dtype=torch.float64)
    months = sorted(set(batch.first) | set(batch.visits))
    for m in range(months[0], months[-1] + 1):
        if m > months[0]:  # carry every slot from month m - 1 to m, by the matrix of its age at m - 1
            year = batch.year0 + (m - 1) // 12
            later = (batch.month_in_year + (m - 1) % 12) >= 12  # (G, N) already a year older
            grid = law.view(groups, n, pairs, JOINT)
            moved = [
                torch.einsum(
                    "gnpi,pgij->gnpj", grid, transitions[:, batch.sex, (year + k).clamp(max=MAX_AGE_YEARS - 1)]
                )
                for k in ((0, 1) if later.any() else (0,))
            ]
            grid = torch.where(later[..., None, None], moved[-1], moved[0])
            law = grid.reshape(batch.slots, pairs, JOINT)
        if m in batch.first:
            slots, steps, sex = batch.first[m]
            law = law.index_copy(0, slots, prior[:, sex, steps].transpose(0, 1))
        for slots, hits in batch.visits.get(m, []):
            hits = hits.to(law.dtype)
            like = torch.einsum("vpc,pjc->vpj", hits, log_e) + torch.einsum("vpc,pjc->vpj", 1.0 - hits, log_not)
            joint = law[slots] * like.exp()
            evidence = joint.sum(dim=-1)  # (V, P)
            total = total + evidence.log().sum().double()
            law = law.index_copy(0, slots, joint / evidence[..., None])
    return total


def fit(rec: Records, train: np.ndarray, max_iter: int = 80, log: bool = True) -> tuple[TorchChain, dict[str, Any]]:
    """The model fitted by L-BFGS to the records of patients ``train`` (indices), and the fit's figures: the
    log-likelihood per visit at the start and the end, the iterations and the CPU seconds."""
    batches = make_batches(rec, train)
    chain = TorchChain(rec.pairs)
    steps = int(rec.age_month0.max()) + rec.months + 1
    n_visits = int(np.isin(rec.patient, train).sum())
    optimizer = torch.optim.LBFGS(
        chain.parameters(), lr=1.0, max_iter=max_iter, history_size=20, line_search_fn="strong_wolfe"
    )
    trace: list[float] = []
    started = time.process_time()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        total = 0.0
        for batch in batches:  # one graph per batch: the memory of one batch's months at a time
            transitions = chain.transitions()
            prior = prior_table(transitions, steps).float()
            loss = -log_likelihood(transitions.float(), prior, chain.emission().float(), batch) / n_visits
            loss.backward()
            total += loss.item()
        trace.append(total)
        if log:
            print(f"  fit: evaluation {len(trace)}, -log-likelihood per visit {total:.5f}", file=sys.stderr, flush=True)
        return torch.tensor(total)

    optimizer.step(closure)
    figures = {
        "start_nll_per_visit": round(trace[0], 5),
        "end_nll_per_visit": round(trace[-1], 5),
        "evaluations": len(trace),
        "cpu_s": round(time.process_time() - started, 1),
    }
    return chain, figures


def fitted_catalogue(chain: TorchChain, rec: Records, train: np.ndarray, codes: np.ndarray) -> ProgressionCatalogue:
    """The catalogue ``chain`` describes (codes named ``codes``), with each background code's chance its share of
    the train patients' visits."""
    rates, coupling = chain.rates()
    at_train = np.isin(rec.patient, train)
    background = rec.hits[at_train, rec.pairs * CODES_PER_PAIR : -1].mean(axis=0).clip(1e-4, 1 - 1e-4)
    emission = chain.emission().detach().numpy()
    return ProgressionCatalogue(codes, _transition_tables(rates, coupling), emission, background)


def reach(cfg: SynthConfig, etl: Path, max_iter: int = 80, log: bool = True) -> dict[str, Any]:
    """The fitted filter against the oracle on ``cfg``'s cohort (its ETL output in ``etl``, for the split):
    see the module docstring."""
    rec = collect_records(cfg)
    split = load_tokens(etl).patients.set_index(S.PATIENT_ID)[S.SPLIT].reindex(patient_ids(cfg.patients)).to_numpy()
    train = np.flatnonzero(split == S.TRAIN)
    chain, figures = fit(rec, train, max_iter, log)
    true_cat = draw_catalogue(cfg)
    believed = fitted_catalogue(chain, rec, train, true_cat.codes)
    tables = {"fitted_structure": progression_oracle(cfg, believed=believed), "oracle": progression_oracle(cfg)}
    ids = patient_ids(cfg.patients)
    held_out = set(ids[split == S.HELD_OUT])
    cuts = tables["oracle"].drop_duplicates(S.PATIENT_ID)
    cuts = cuts[cuts[S.PATIENT_ID].isin(held_out)]
    index = {p: i for i, p in enumerate(ids)}
    patient = cuts[S.PATIENT_ID].map(index).to_numpy()
    cut_day = cuts[S.PREDICTION_TIME].to_numpy().astype("datetime64[D]").astype(np.int64)
    outcome = _next_visit_hits(rec, patient, cut_day)
    row = {p: i for i, p in enumerate(cuts[S.PATIENT_ID])}
    cols = {c: j for j, c in enumerate(true_cat.codes)}
    scores = {}
    for name, table in tables.items():
        t = table[table[S.PATIENT_ID].isin(row)]
        matrix = np.zeros(outcome.shape)
        matrix[t[S.PATIENT_ID].map(row).to_numpy(), t[S.CODE].map(cols).to_numpy()] = t[S.PROBABILITY].to_numpy()
        scores[name] = matrix
    ok = [j for j in range(outcome.shape[1]) if 0 < outcome[:, j].sum() < len(outcome)]
    per_code = {
        str(true_cat.codes[j]): {
            name: float(average_precision_score(outcome[:, j], s[:, j])) for name, s in scores.items()
        }
        for j in ok
    }
    true_nll = -records_log_likelihood(rec, train, true_cat) / int(np.isin(rec.patient, train).sum())
    return {
        "samples_at_cuts": len(outcome),
        "codes": len(ok),
        **{f"{name}_macro_ap": round(float(np.mean([e[name] for e in per_code.values()])), 5) for name in scores},
        "fit": figures | {"true_parameters_nll_per_visit": round(true_nll, 5)},
        "per_code": per_code,
    }


def _next_visit_hits(rec: Records, patient: np.ndarray, cut_day: np.ndarray) -> np.ndarray:
    """``(len(patient), codes)`` the codes of each patient's first visit after ``cut_day``."""
    first_row = np.searchsorted(rec.patient, patient)  # rec is sorted by patient, then by day
    out = np.zeros((len(patient), rec.hits.shape[1]), dtype=bool)
    for i, (p, start, day) in enumerate(zip(patient, first_row, cut_day)):
        j = start
        while rec.patient[j] == p and rec.day[j] <= day:
            j += 1
        out[i] = rec.hits[j]
    return out


def records_log_likelihood(rec: Records, patients: np.ndarray, cat: ProgressionCatalogue) -> float:
    """The log-likelihood of the pair codes recorded for ``patients`` under catalogue ``cat`` (float64; the
    oracle's filter's :attr:`~synthetic_data.progression.StageFilter.log_likelihood` summed, without simulating
    the cohort again)."""
    transitions = torch.as_tensor(cat.transitions)
    prior = prior_table(transitions, int(rec.age_month0.max()) + rec.months + 1)
    emission = torch.as_tensor(cat.emission)
    with torch.no_grad():
        return sum(float(log_likelihood(transitions, prior, emission, b)) for b in make_batches(rec, patients))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path, help="a quality.py cohort folder (cohort, etl, ...)")
    parser.add_argument("--max-iter", type=int, default=80, help="L-BFGS iterations")
    args = parser.parse_args()
    from benchmarks.quality import cohort_config, gap_anchors, reach_share  # quality.py imports this module

    out = reach(cohort_config(args.work / "cohort"), args.work / "etl", args.max_iter)
    evaluated = args.work / "evaluate" / "metrics.json"
    if evaluated.exists():  # the model's evaluation: the share of its gap, over its labels
        metrics = json.loads(evaluated.read_text())
        labels = json.loads((args.work / "finetune" / "metrics.json").read_text())["label_codes"]
        low, high = gap_anchors(metrics)
        model = metrics["ceiling"]["predictors"]["model"]["overall"]["macro_ap"]
        out["over_the_model_s_labels"] = {
            name: reach_share(out["per_code"], labels, low, high, name) for name in ("fitted_structure", "oracle")
        } | {"model_gap_closed": round((model - low) / (high - low), 4)}
    print(json.dumps({k: v for k, v in out.items() if k != "per_code"} | {"per_code": out["per_code"]}, indent=1))


if __name__ == "__main__":
    main()
