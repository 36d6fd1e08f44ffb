"""The ceiling on synthetic data: the generator's true next-visit probabilities, and how far a model gets.

``behrt-rope synth synth.oracle=true`` writes ``oracle.parquet``: for one cut visit per patient, the true
probability of each code at the next visit (see ``synthetic_data/oracle.py``). Evaluation matches those
cuts to the held-out samples, scores every predictor on exactly those samples, and reports the share of the
gap between the logistic regression and the oracle that each predictor closes on macro AP::

    gap closed = (AP(predictor) - AP(logistic regression)) / (AP(oracle) - AP(logistic regression))

with a paired bootstrap interval (every predictor's replicate ``b`` resamples the same samples).

The same share is also given apart for the two kinds of (sample, code) cells that :data:`HISTORY_PARTS`
names: codes already on file for the patient and codes not yet recorded (new onsets). The oracle knows
conditions that have begun but are not yet recorded, which no model of the recorded history can see, so its
lead on new onsets is partly out of any model's reach; on codes already on file it is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.data.labels import Samples
from behrt_rope.data.sequences import Sequences
from behrt_rope.errors import UserError
from behrt_rope.etl.codes import tokens_of
from behrt_rope.etl.config import EtlConfig
from behrt_rope.evaluation.metrics import CI_LEVEL, bootstrap_replicates, percentile_interval, summary_metrics

ORACLE = "oracle"
ORACLE_COLUMNS = (S.PATIENT_ID, S.PREDICTION_TIME, S.CODE, S.PROBABILITY)
HISTORY_PARTS = {"on_file": "codes already on file", "new_onset": "new onsets (codes not yet recorded)"}
"""The two parts of the cells at the cuts, by whether the label's code is in the sample's input history."""


CEILINGS = {"ceiling": S.ORACLE_FILE, "ceiling_record": S.RECORD_ORACLE_FILE}
"""The ceilings evaluation reports, by ``metrics.json`` key: the state oracle (the generator's true
probabilities) and, when the cohort has one, the record oracle (the best prediction from the recorded
history alone; ``synthetic_data/record_oracle.py``)."""


def oracle_files(path: str | Path) -> dict[str, Path]:
    """The oracle tables to evaluate against, by :data:`CEILINGS` key: a ``synth`` output directory gives its
    ``oracle.parquet`` and, if written, its ``oracle_record.parquet``; a file is the one ceiling, the record
    oracle if it has that file's name.

    >>> oracle_files("cohort/oracle_record.parquet"), oracle_files("elsewhere/true.parquet")
    ({'ceiling_record': PosixPath('cohort/oracle_record.parquet')}, {'ceiling': PosixPath('elsewhere/true.parquet')})
    """
    folder = Path(path)
    if not folder.is_dir():
        return {"ceiling_record" if folder.name == S.RECORD_ORACLE_FILE else "ceiling": folder}
    files = {key: folder / name for key, name in CEILINGS.items()}
    return {key: file for key, file in files.items() if key == "ceiling" or file.exists()}


def read_oracle(path: str | Path) -> pd.DataFrame:
    """The oracle table, checked: ``patient_id`` (str), ``prediction_time`` (date), ``code``, ``probability``."""
    file = Path(path)
    if file.is_dir():
        file = file / S.ORACLE_FILE
    if not file.exists():
        raise UserError(f"{file}: no oracle file (write one with `behrt-rope synth ... synth.oracle=true`)")
    frame = pq.read_table(file).to_pandas()
    missing = [c for c in ORACLE_COLUMNS if c not in frame.columns]
    if missing:
        raise UserError(f"{file}: oracle table lacks column(s) {missing}; it has {list(frame.columns)}")
    frame[S.PATIENT_ID] = frame[S.PATIENT_ID].astype(str)
    frame[S.PREDICTION_TIME] = pd.to_datetime(frame[S.PREDICTION_TIME]).dt.normalize()
    bad = ~frame[S.PROBABILITY].between(0.0, 1.0)
    if bad.any():
        raise UserError(f"{file}: probability outside [0, 1], e.g. row {frame[bad].iloc[0].to_dict()}")
    return frame


def oracle_matrix(
    oracle: pd.DataFrame, seqs: Sequences, samples: Samples, labels: Sequence[str], etl: EtlConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Match oracle cuts to samples: ``(sample indices (K,), probabilities (K, L))``.

    A sample matches when its patient and prediction day equal a cut's. Oracle codes are turned into tokens
    with the ETL's own code normalisation (``etl``), so they name the label columns; a label the oracle
    does not list has probability 0. Raises when two oracle codes become one token (e.g. under
    ``code_truncate``): the probability of "either" is not the sum, so no honest ceiling exists there.
    """
    codes = oracle[S.CODE].astype(str).to_numpy(dtype=object)
    tokens = tokens_of(codes, np.full(len(codes), "", dtype=object), etl)
    distinct = pd.DataFrame({"code": codes, "token": tokens}).drop_duplicates()
    clashes = distinct[distinct["token"].duplicated(keep=False)]
    if len(clashes):
        raise UserError(
            f"oracle codes {sorted(clashes['code'])[:4]} become one token under this ETL's code settings; "
            "evaluate against the oracle on an ETL without code_truncate"
        )
    column = {code: j for j, code in enumerate(labels)}
    patient_ids = seqs.patients[S.PATIENT_ID].astype(str).to_numpy()
    keys = pd.DataFrame(
        {
            S.PATIENT_ID: patient_ids[samples.rows],
            S.PREDICTION_TIME: pd.to_datetime(samples.times.astype("datetime64[D]")),
            "sample": np.arange(len(samples)),
        }
    ).drop_duplicates([S.PATIENT_ID, S.PREDICTION_TIME])
    rows = oracle.assign(label=[column.get(t, -1) for t in tokens]).merge(keys, on=[S.PATIENT_ID, S.PREDICTION_TIME])
    matched = np.unique(rows["sample"].to_numpy())
    probs = np.zeros((len(matched), len(labels)))
    rows = rows[rows["label"] >= 0]
    probs[np.searchsorted(matched, rows["sample"].to_numpy()), rows["label"].to_numpy()] = rows[S.PROBABILITY]
    return matched, probs


def format_share(gap: Mapping[str, Any] | None, ci: bool = True, missing: str = "–") -> str:
    """A :func:`gap_closed` entry as text: ``"63% (52% to 73%)"`` (``ci=False``: ``"63%"``), or ``missing``
    when there is no share.

    >>> format_share({"point": 0.634, "ci": [0.52, 0.731]}), format_share({"point": 0.634}), format_share(None)
    ('63% (52% to 73%)', '63%', '–')
    """
    share = (gap or {}).get("point")
    if share is None:
        return missing
    text = f"{100 * share:.0f}%"
    low, high = ((gap or {}).get("ci") or [None, None])[:2]
    if ci and low is not None and high is not None and np.isfinite([low, high]).all():
        text += f" ({100 * low:.0f}% to {100 * high:.0f}%)"
    return text


def both_shares(entry: Mapping[str, Any]) -> str:
    """A ceiling predictor's gap closed from the every-visit and from the one-cut regression, ``"63% / 61%"``
    (``"n/a"`` for a missing one).

    >>> both_shares({"gap_closed": {"point": 0.634}, "gap_closed_one_cut": None})
    '63% / n/a'
    """
    gaps = (entry.get("gap_closed"), entry.get("gap_closed_one_cut"))
    return " / ".join(format_share(gap, ci=False, missing="n/a") for gap in gaps)


def gap_closed(evaluations: Mapping[str, Mapping[str, Any]], low: str, metric: str = "macro_ap") -> dict[str, Any]:
    """Per predictor, the share of the ``low`` -> oracle gap on ``metric`` it closes, with a paired interval.

    ``evaluations`` maps predictor names (``low`` and :data:`ORACLE` among them) to ``evaluate_scores``
    results on the same samples with the same bootstrap draws. Returns ``{name: {"point", "ci"}}``; the
    point is None when the oracle is no better than ``low`` (no gap to close).
    """

    def value(name: str) -> float:
        return float(evaluations[name]["overall"][metric])

    def replicates(name: str) -> np.ndarray:
        return np.asarray(evaluations[name]["bootstrap"]["overall"][metric], dtype=float)

    gap = value(ORACLE) - value(low)
    gaps = replicates(ORACLE) - replicates(low)
    out: dict[str, Any] = {}
    for name in evaluations:
        if gap <= 0:
            out[name] = {"point": None, "ci": [None, None]}
            continue
        shares = np.where(gaps > 0, (replicates(name) - replicates(low)) / np.where(gaps > 0, gaps, 1.0), np.nan)
        point = (value(name) - value(low)) / gap
        out[name] = {"point": point, "ci": list(percentile_interval(shares, CI_LEVEL, point))}
    return out


def gap_by_history(
    y: np.ndarray,
    predictions: Mapping[str, np.ndarray],
    history: np.ndarray,
    low: str,
    n_bootstrap: int,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Macro AP and gap closed on each of :data:`HISTORY_PARTS` apart.

    ``y`` (K, L) 0/1 outcomes at the cuts, ``predictions`` {name: (K, L) probabilities} with ``low`` and
    :data:`ORACLE` among them, ``history`` (K, L) bool (code already in the input). Returns
    ``{part: {name: {"macro_ap", "ci", "n_codes_macro", "gap_closed"}}}``, every predictor on the same
    bootstrap draws (``n_bootstrap``, ``seed``), macro AP over the codes with a positive and a negative in
    the part."""
    masks = {"on_file": history, "new_onset": ~history}
    parts: dict[str, dict[str, Any]] = {}
    for part in HISTORY_PARTS:
        evaluations = {
            name: {
                "overall": summary_metrics(y, scores, masks[part]),
                "bootstrap": {"overall": bootstrap_replicates(y, scores, masks[part], n_bootstrap, seed)},
            }
            for name, scores in predictions.items()
        }
        closed = gap_closed(evaluations, low)
        parts[part] = {}
        for name, e in evaluations.items():
            point, replicates = e["overall"]["macro_ap"], e["bootstrap"]["overall"]["macro_ap"]
            parts[part][name] = {
                "macro_ap": point,
                "ci": list(percentile_interval(replicates, CI_LEVEL, point)),
                "n_codes_macro": e["overall"]["n_codes_macro"],
                "gap_closed": closed[name],
            }
    return parts


def per_code_at_cuts(evaluations: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each label code's AP for every predictor at the cuts, from :func:`evaluate_scores` results by predictor
    name (all on the same samples): ``[{"code", "n_positive", "ap": {name: AP or None}}]``, most prevalent first.
    Which codes a model trails the oracle on is what its macro AP alone cannot tell.

    >>> rows = lambda aps: [{"code": c, "n_positive": n, "ap": a} for c, n, a in zip("AB", (9, 4), aps)]
    >>> per_code_at_cuts({"model": {"per_code": rows((0.5, None))}, "oracle": {"per_code": rows((0.7, 0.2))}})[1]
    {'code': 'B', 'n_positive': 4, 'ap': {'model': None, 'oracle': 0.2}}
    """
    table: dict[str, dict[str, Any]] = {}
    for name, evaluation in evaluations.items():
        for row in evaluation["per_code"]:
            entry = table.setdefault(row[S.CODE], {"code": row[S.CODE], "n_positive": row["n_positive"], "ap": {}})
            entry["ap"][name] = row["ap"]
    return list(table.values())
