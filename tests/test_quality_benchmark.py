"""The quality benchmark's docs table: every predictor's row carries the gap closed overall and apart on codes
already on file and on new onsets (``benchmarks/quality.py``; the benchmark itself is too slow for tests)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from behrt_rope import schema as S
from behrt_rope.cli import main
from benchmarks.quality import (
    COHORTS,
    PREDICTORS,
    cohort_args,
    finetune_choices,
    fitted_form_reach,
    markdown,
    model_lead,
    write_record_oracle,
)
from benchmarks.quality import main as quality_main
from benchmarks.recurrence_ceiling import FEATURES, at_cut, collect, design, fitted_forms
from synthetic_data.generator import SynthConfig
from tests.fixtures_quality import ceiling_metrics, cohort_with_oracle


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


ALL_HELD_OUT = {"n_samples": 900, "model": _entry(0.0, None, None), "gradient_boosting": _entry(0.0, None, None)}


def test_table_has_the_history_split_per_predictor():
    cuts = {"n_samples": 100, "model": _entry(0.42, 0.61, 0.12), "oracle": _entry(1.0, 1.0, 1.0)}
    cuts["logistic_regression"] = _entry(0.0, None, None)  # an evaluation written before the split
    results = {
        "cohorts": {
            "default": {
                "patients": 8000,
                "tokens_per_patient": 50.0,
                "at_oracle_cuts": cuts,
                "all_held_out": ALL_HELD_OUT,
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


def test_table_adds_the_record_oracle_columns_when_a_cohort_has_them():
    model = _entry(0.42, 0.61, 0.12) | {
        "gap_closed_record": {"point": 0.62, "ci": [0.42, 0.83]},
        "gap_closed_record_by_history": {"on_file": {"point": 0.67}, "new_onset": {"point": 0.6}},
    }
    cohort = {
        "patients": 8000,
        "tokens_per_patient": 50.0,
        "train_cpu_s": 400.0,
        "train_wall_s": 390.0,
        "at_oracle_cuts": {"n_samples": 100, "model": model, "oracle": _entry(1.0, 1.0, 1.0)},
        "all_held_out": ALL_HELD_OUT,
        "record_oracle_macro_ap": {"point": 0.2577, "ci": None},
    }
    recurrence = cohort | {"at_oracle_cuts": {"n_samples": 100, "model": _entry(0.8, 0.8, 0.3)}}
    del recurrence["record_oracle_macro_ap"]  # no record oracle for the recurrence family
    table = markdown({"cohorts": {"default": cohort, "recurrence": recurrence}}).split("\n\n")[0].splitlines()
    header = table[0]
    assert header.endswith("| gap closed to the record oracle (95% CI) | on file / new onsets |")
    rows = {tuple(line.split(" | ")[:2]): line for line in table[2:]}
    assert rows[("| default", "model")].endswith("| 62% (42% to 83%) | 67% / 60% |")
    assert rows[("| default", "record oracle")].startswith("| default | record oracle | 0.258 |")
    assert rows[("| recurrence", "model")].endswith("| – | – / – |")
    assert all(row.count("|") == header.count("|") for row in rows.values())


def test_the_model_s_lead_over_each_reference_is_paired_over_the_same_resamples():
    """Replicate b of every predictor resamples the same cuts: the lead's interval comes from the differences,
    which are tight when the two predictors move together even where each one's own interval is wide."""
    rng = np.random.default_rng(0)
    shared = rng.normal(0.0, 0.02, 200)  # what every predictor's replicate shares (the resampled cuts)
    model_reps = 0.26 + shared + rng.normal(0.0, 0.001, 200)
    predictors = {
        "model": {"overall": {"macro_ap": 0.26}, "bootstrap": {"overall": {"macro_ap": model_reps.tolist()}}},
        "gradient_boosting": {
            "overall": {"macro_ap": 0.25},
            "bootstrap": {"overall": {"macro_ap": (0.25 + shared).tolist()}},
        },
        "logistic_regression": {"overall": {"macro_ap": 0.22}},  # written without replicates
    }  # fmt: skip
    lead = model_lead(predictors, "gradient_boosting")
    assert lead is not None and lead["point"] == pytest.approx(0.01)
    low, high = lead["ci"]
    assert 0.007 < low < 0.01 < high < 0.013  # unpaired, the intervals would overlap (each about +-0.04)
    assert model_lead(predictors, "logistic_regression") == {"point": pytest.approx(0.04), "ci": None}
    assert model_lead(predictors, "sparse_time_regression") is None

    cuts = {"n_samples": 100, "model": _entry(0.5, None, None), "oracle": _entry(1.0, None, None)}
    cuts["gradient_boosting"] = _entry(0.4, None, None) | {"model_minus_this": {"point": 0.0123, "ci": [0.004, 0.02]}}
    cuts["logistic_regression"] = _entry(0.0, None, None) | {"model_minus_this": {"point": 0.03, "ci": None}}
    cohort = {"patients": 8000, "tokens_per_patient": 50.0, "at_oracle_cuts": cuts, "all_held_out": ALL_HELD_OUT,
              "train_cpu_s": 400.0, "train_wall_s": 390.0}  # fmt: skip
    lead_table = markdown({"cohorts": {"default": cohort}}).split("\n\n")[1].splitlines()
    assert lead_table[0].startswith("| cohort | model minus logistic_regression (paired 95% CI) |")
    assert "model minus gradient_boosting (paired 95% CI)" in lead_table[0]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in (lead_table[0], lead_table[2])]
    row = dict(zip(*cells))
    assert row["model minus gradient_boosting (paired 95% CI)"] == "+0.0123 (+0.0040 to +0.0200)"
    assert row["model minus logistic_regression (paired 95% CI)"] == "+0.0300"
    assert lead_table[2].count("|") == lead_table[0].count("|")


def test_a_window_task_has_the_held_out_and_cost_tables_without_oracle_columns():
    """``--task 12m`` has no oracle: its cohorts appear on every held-out sample, not at the oracle's cuts."""
    window = {"task": "12m", "patients": 8000, "tokens_per_patient": 50.0, "all_held_out": ALL_HELD_OUT,
              "train_cpu_s": 400.0, "train_wall_s": 390.0}  # fmt: skip
    tables = markdown({"cohorts": {"recurrence": window}}).split("\n\n")
    assert len(tables) == 2 and "gap closed" not in tables[0]
    held_out = tables[0].splitlines()
    assert held_out[2] == "| recurrence | 12m | model | 0.250 (0.240-0.260) | 0.400 | 0.800 |"
    assert [line.split(" | ")[2] for line in held_out[2:]] == ["model", "gradient_boosting"]
    assert tables[1].splitlines()[2] == "| recurrence | 8000 | 50.0 | 900 (–) | 400 (390) |"


def test_record_oracle_is_written_for_the_held_out_patients_beside_the_state_oracle(tmp_path):
    cohort, etl = tmp_path / "cohort", tmp_path / "etl"
    assert main(["synth", "--out", str(cohort), "--patients", "120", "--seed", "3", "oracle=true",
                 "oracle_replicas=5"]) == 0  # fmt: skip
    assert main(["etl", "--input", str(cohort), "--out", str(etl), "progress=false", "etl.split.train=0.5",
                 "etl.split.tuning=0.1", "etl.split.held_out=0.4"]) == 0  # fmt: skip
    seconds = write_record_oracle(cohort, etl, particles=10, replicas=5)
    assert seconds["wall_s"] >= 0
    record, state = pd.read_parquet(cohort / S.RECORD_ORACLE_FILE), pd.read_parquet(cohort / S.ORACLE_FILE)
    tokens = pd.read_parquet(etl / S.TOKENS_DIR, columns=[S.PATIENT_ID, S.SPLIT])
    held = set(tokens.loc[tokens[S.SPLIT] == S.HELD_OUT, S.PATIENT_ID])
    expected = held & set(state[S.PATIENT_ID])  # the held-out patients with a cut
    # a cut where every copy dies before the next visit has no probabilities (likely with 5 replicas)
    assert set(record[S.PATIENT_ID]) <= expected and record[S.PATIENT_ID].nunique() >= 0.9 * len(expected)
    key = [S.PATIENT_ID, S.PREDICTION_TIME]
    cuts = state[state[S.PATIENT_ID].isin(set(record[S.PATIENT_ID]))][key].drop_duplicates()
    cuts = cuts.sort_values(key, ignore_index=True)
    pd.testing.assert_frame_equal(record[key].drop_duplicates().sort_values(key, ignore_index=True), cuts)


def test_reach_fits_the_generator_s_form_on_the_train_patients_and_scores_it_over_the_model_s_labels(tmp_path):
    cohort, etl = cohort_with_oracle(tmp_path, 400, 5, "synth.process=recurrence", "oracle_replicas=5")
    codes = sorted(pd.read_parquet(cohort / S.ORACLE_FILE)[S.CODE].unique())
    labels = [c.replace(".", "") for c in codes[:10]]  # as an ETL that strips dots writes them
    low, high = 0.1, 0.5
    metrics = ceiling_metrics(low, high)
    reach = fitted_form_reach(cohort, etl, metrics, labels)
    fits = ("true_shapes", "binned_shapes", "true_shapes_at_cut", "binned_shapes_at_cut")
    assert set(reach) == {*fits, "cpu_s"}
    for entry in (reach[fit] for fit in fits):
        assert 1 <= entry["codes"] <= 10  # only the model's labels (those with a positive at the cuts)
        assert 0.0 <= entry["macro_ap"] <= 1.0
        assert entry["gap_closed"] == pytest.approx((entry["macro_ap"] - low) / (high - low), abs=1e-3)
    assert len({reach[fit]["macro_ap"] for fit in fits}) == 4  # four different designs
    # the two fits share one simulation: the binned fit alone (its own simulation) is the same fit
    alone = fitted_forms(SynthConfig(patients=400, seed=5, process="recurrence"), etl, ("binned",))["binned"]
    both = fitted_forms(SynthConfig(patients=400, seed=5, process="recurrence"), etl, ("true", "binned"))
    assert alone == both["binned"] and both["true"]["per_code"] != alone["per_code"]


def test_the_fit_at_the_cut_reads_the_cut_s_day_and_nothing_else_changes():
    """Read at the cut, the day-dependent columns (age bump, duration, trigger ramps) are those of the visit
    before; what the record holds at the cut (seen, counts, recency, follow-up) is the same as at the visit."""
    cfg = SynthConfig(patients=300, seed=7, process="recurrence")
    _, _, (on_visit_day, on_cut_day), _, _ = collect(cfg, design, at_cut(design))
    day_free = [FEATURES.index(f) for f in ("female", "visit_count", "seen", "count", "recency", "followup")]
    np.testing.assert_array_equal(on_visit_day[..., day_free], on_cut_day[..., day_free])
    age, duration = FEATURES.index("age_bump"), FEATURES.index("duration")
    assert not np.allclose(on_visit_day[..., age], on_cut_day[..., age])
    seen = on_visit_day[..., FEATURES.index("seen")] > 0
    before, at_visit = on_cut_day[..., duration][seen], on_visit_day[..., duration][seen]
    assert (before <= at_visit + 1e-12).all() and (before < at_visit).any()  # fewer years since first on the cut's day


def test_reach_table_reads_the_model_s_share_of_the_told_form_s_gap():
    cuts = {"n_samples": 100, "model": _entry(0.72, None, None), "oracle": _entry(1.0, None, None)}
    reach = {"true_shapes": {"gap_closed": 0.9}, "binned_shapes": {"gap_closed": 0.75},
             "true_shapes_at_cut": {"gap_closed": 0.8}, "binned_shapes_at_cut": {"gap_closed": 0.7}}  # fmt: skip
    cohort = {"patients": 8000, "tokens_per_patient": 20.0, "at_oracle_cuts": cuts, "all_held_out": ALL_HELD_OUT,
              "train_cpu_s": 200.0, "train_wall_s": 210.0}  # fmt: skip
    tables = markdown({"cohorts": {"recurrence_sparse": cohort | {"reach": reach}}}).split("\n\n")
    assert "| recurrence_sparse | 72% | 90% | 75% | 80% | 80% / 70% | 90% |" in tables[2].splitlines()
    earlier = {k: v for k, v in reach.items() if not k.endswith("_at_cut")}  # a run from before the cut's fits
    old_tables = markdown({"cohorts": {"recurrence_sparse": cohort | {"reach": earlier}}}).split("\n\n")
    assert "| recurrence_sparse | 72% | 90% | 75% | 80% | — | — |" in old_tables[2].splitlines()
    assert not any("shapes told" in t for t in markdown({"cohorts": {"recurrence_sparse": cohort}}).split("\n\n"))


def test_a_seed_offset_draws_every_cohort_afresh_and_keeps_its_shape():
    for name, args in COHORTS.items():
        moved = cohort_args(name, 7000)
        seed = args.index("--seed") + 1
        assert int(moved[seed]) == int(args[seed]) + 7000
        assert moved[:seed] + moved[seed + 1 :] == args[:seed] + args[seed + 1 :]  # the same shape
        assert cohort_args(name) == args
    assert COHORTS["recurrence"] == ["--seed", "3031", "synth.process=recurrence"]  # the table is not changed


def test_a_negative_seed_offset_is_refused(capsys):
    with pytest.raises(SystemExit):
        quality_main(["--seed-offset", "-1"])
    assert "--seed-offset must be >= 0, got -1" in capsys.readouterr().err


def test_the_record_says_what_finetune_chose_and_leaves_out_what_it_did_not_record():
    recorded = {
        "epochs": 20,
        "time_budget_stopped": False,
        "sparse_time_distillation": 0.0,
        "distillation_choice": {"weights_tried": [0.0]},
        "sparse_time_share": 0.6,
        "state_path": {"share": 0.5, "epochs": 31, "fitted": True},
        "stage_seconds": 702.5,
        "tuning_macro_ap": 0.31,
    }
    assert finetune_choices(recorded) == {
        "epochs": 20,
        "time_budget_stopped": False,
        "distillation_weight": 0.0,
        "distillation_weights_tried": [0.0],
        "sparse_time_share": 0.6,
        "state_path_share": 0.5,
        "state_path_epochs": 31,
        "stage_seconds": 702.5,
    }
    # a run without the state path or the distillation choice (older metrics, paths off): only what it recorded
    assert finetune_choices({"epochs": 8, "sparse_time_share": 0.5}) == {"epochs": 8, "sparse_time_share": 0.5}
