"""The quality benchmark's docs table: every predictor's row carries the gap closed overall and apart on codes
already on file and on new onsets (``benchmarks/quality.py``; the benchmark itself is too slow for tests)."""

from __future__ import annotations

from benchmarks.quality import PREDICTORS, markdown


def _entry(share: float, on_file: float | None, new: float | None) -> dict:
    parts = {} if on_file is None else {"on_file": {"point": on_file}, "new_onset": {"point": new}}
    return {
        "macro_ap": {"point": 0.25, "ci": [0.24, 0.26]},
        "micro_ap": {"point": 0.4, "ci": None},
        "macro_auroc": {"point": 0.8, "ci": None},
        "gap_closed": {"point": share, "ci": [share - 0.1, share + 0.1]},
        "gap_closed_one_cut": None,
        "gap_closed_by_history": parts,
    }


def test_table_has_the_history_split_per_predictor():
    cuts = {"n_samples": 100, "model": _entry(0.42, 0.61, 0.12), "oracle": _entry(1.0, 1.0, 1.0)}
    cuts["logistic_regression"] = _entry(0.0, None, None)  # an evaluation written before the split
    results = {
        "cohorts": {
            "default": {
                "patients": 8000,
                "tokens_per_patient": 50.0,
                "at_oracle_cuts": cuts,
                "train_cpu_s": 400.0,
                "train_wall_s": 390.0,
            }
        }
    }
    predictor_table = markdown(results).split("\n\n")[0].splitlines()
    header = predictor_table[0]
    assert header.endswith("| on codes on file | on new onsets |")
    rows = {line.split(" | ")[1]: line for line in predictor_table if line.startswith("| default | ")}
    assert set(rows) == {p for p in PREDICTORS if p in cuts}
    assert rows["model"].endswith("| 42% (32% to 52%) | – | 61% | 12% |")
    assert rows["logistic_regression"].endswith("| – | – |")
    assert all(row.count("|") == header.count("|") for row in rows.values())
