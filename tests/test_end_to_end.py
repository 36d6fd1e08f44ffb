"""Every stage through the real CLI on tiny settings: synth, etl, pretrain, finetune, evaluate, predict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.evaluation.baseline import C_GRID, GBM_GRID, GBM_TUNING_LABELS
from behrt_rope.evaluation.ceiling import format_share
from behrt_rope.evaluation.sparse_time import C_GRID as SPARSE_C_GRID
from behrt_rope.evaluation.sparse_time import SELECT_C
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.sparse_time_fit import SHARE_GRID
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, error_line, read_metrics

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FINETUNE_FAST = ("--max-epochs", "1", "task.min_label_count=2", "sparse_time_distillation=0", *FAST_TRAINER)
"""One epoch at one distillation weight: the default's second training is tested in test_distillation_choice."""
GBM_FIXED = "gradient_boosting_setting=moderate"
"""Gradient boosting at one setting where a test is not about choosing it: the grid takes most of a tiny
evaluation (visits_run's evaluation keeps the choice, which test_evaluate_writes_metrics_and_a_readable_report
checks)."""


def _run(*argv: str) -> None:
    assert main(list(argv)) == 0, f"behrt-rope {' '.join(argv)} failed"


def _pipeline(root: Path, raw: Path, fmt: str, *etl_overrides: str, evaluate: tuple[str, ...] = ()) -> dict[str, Path]:
    """etl -> pretrain -> finetune -> evaluate (with ``evaluate`` overrides) on ``raw``; the stage directories."""
    d = {name: root / name for name in ("etl", "pre", "ft", "eval")}
    _run("etl", "--input", str(raw), "--out", str(d["etl"]), "--format", fmt, "progress=false", *etl_overrides)
    _run("pretrain", "--data", str(d["etl"]), "--out", str(d["pre"]), "--max-epochs", "1", *TINY_MODEL, *FAST_TRAINER)
    _run("finetune", "--data", str(d["etl"]), "--out", str(d["ft"]), "--pretrained", str(d["pre"]), *FINETUNE_FAST)
    _run(
        "evaluate",
        "--model",
        str(d["ft"]),
        "--data",
        str(d["etl"]),
        "--out",
        str(d["eval"]),
        "n_bootstrap=10",
        "progress=false",
        *evaluate,
    )
    return d


@pytest.fixture(scope="module")
def visits_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    _run("synth", "--out", str(root / "cohort"), "--patients", "250", "--seed", "3", "synth.corrupt_fraction=0.01")
    return root, _pipeline(root, root / "cohort", "visits", "etl.code_truncate=3")


@pytest.mark.slow
def test_evaluate_writes_metrics_and_a_readable_report(visits_run):
    _, d = visits_run
    metrics = read_metrics(d["eval"])
    sides = [metrics["model"], *metrics["baselines"].values()]
    assert set(metrics["baselines"]) == {
        "logistic_regression",
        "logistic_regression_one_cut",
        "gradient_boosting",
        "sparse_time_regression",
        "model_deep_part",  # the ablation: the default model without its sparse time path
    }
    assert metrics["baselines"]["model_deep_part"]["overall"] != metrics["model"]["overall"]
    for side in sides:
        overall = side["overall"]
        assert 0.0 <= overall["macro_ap"] <= 1.0 and 0.0 <= overall["micro_auroc"] <= 1.0
        assert side["new_onset"] is not None
    assert metrics["ceiling"] is None  # no oracle given
    assert metrics["pretrain"]["mlm_loss"] > 0
    for name in ("logistic_regression", "logistic_regression_one_cut"):  # each regression's C, from the tuning split
        choice = metrics["baseline_c"][name]
        assert choice["chosen_on"] == "tuning split" and choice["c"] in C_GRID
        by_c = {float(c): ap for c, ap in choice["tuning_macro_ap"].items()}
        assert list(by_c) == list(C_GRID) and by_c[choice["c"]] == max(by_c.values())
    gbm = metrics["gradient_boosting_setting"]  # gradient boosting's regularisation, also from the tuning split
    assert gbm["chosen_on"] == "tuning split" and gbm["params"] == GBM_GRID[gbm["setting"]]
    assert list(gbm["tuning_macro_ap"]) == list(GBM_GRID) and 1 <= gbm["tuning_labels"] <= GBM_TUNING_LABELS
    assert gbm["tuning_macro_ap"][gbm["setting"]] == max(gbm["tuning_macro_ap"].values())
    sparse = metrics["sparse_time_c"]  # the sparse time regression's penalty, also from the tuning split
    assert sparse["chosen_on"] == "tuning split" and sparse["c"] in SPARSE_C_GRID
    assert sparse["tuning_macro_ap"][f"{sparse['c']:g}"] == max(sparse["tuning_macro_ap"].values())
    html = (d["eval"] / S.REPORT_FILE).read_text()
    assert (sparse["select_c"], sparse["bins"]) == (SELECT_C, "cumulative")  # the report names both, and the bins
    line = "L1 regression on cumulative bins of the time features of every label code"
    assert f"{line} (relaxed: codes chosen at C={SELECT_C:g}, refit at C={sparse['c']:g}, tuning split)" in html
    assert "data:image/png;base64," in html and 'src="http' not in html
    assert "Bag-of-codes logistic regression" in html and "New-onset metrics" in html
    assert f"C={metrics['baseline_c']['logistic_regression']['c']:g}, tuning split" in html
    assert f"({gbm['setting']} regularisation, tuning split)" in html
    assert "Gradient boosting on time features" in html and "Against the reference models" in html
    assert f"{metrics['model']['overall']['macro_ap']:.3f}" in html  # the headline number is the one computed
    trained = read_metrics(d["ft"])  # how the model was fine-tuned, as its run recorded it
    assert f"{trained['epochs']} epochs" in html and "distillation weight 0 (set)" in html
    assert (d["eval"] / S.PLOTS_DIR).is_dir()


@pytest.mark.slow
def test_finetune_outputs_and_resume(visits_run):
    _, d = visits_run
    metrics = read_metrics(d["ft"])
    assert metrics["labels"] > 0 and metrics["train_samples"] > 0
    assert 1 <= metrics["best_epoch"] <= metrics["epochs"]  # the growing-patience early stopping is on by default
    # the default 12-minute budget of the stage is recorded, and a tiny run is far inside it
    assert metrics["time_budget_minutes"] == 12.0 and metrics["time_budget_stopped"] is False
    assert metrics["time_budget_planned_epochs"] == 1 and 0 < metrics["train_seconds"] <= metrics["stage_seconds"]
    assert (d["ft"] / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT).exists()
    # the default model carries its fitted sparse time path: at least each label's rate, on the logit scale
    fitted = _sparse_time_buffers(d["ft"])
    assert {"sparse_time.own_weight", "sparse_time.shared_weight", "sparse_time.bias"} <= set(fitted)
    assert bool((fitted["sparse_time.bias"] < 0).all())  # every label is rarer than 1 in 2 visits here
    # its share of the logit is 0.5 unless another grid value is clearly better on the tuning split
    by_share = {float(w): ap for w, ap in metrics["tuning_macro_ap_by_share"].items()}
    assert set(by_share) == set(SHARE_GRID) and metrics["sparse_time_share"] in SHARE_GRID
    over_half = metrics["sparse_time_share_over_0.5"]
    clearly = {float(w): v["difference"] for w, v in over_half.items() if w != "level" and v["low"] > 0}
    assert over_half["level"] == 0.9 and set(over_half) == {"level"} | {f"{w:g}" for w in SHARE_GRID if w != 0.5}
    assert metrics["sparse_time_share"] == (max(clearly, key=clearly.__getitem__) if clearly else 0.5)
    # ... scored as the saved model scores (eval mode): the same tuning macro AP as the final validation
    assert by_share[metrics["sparse_time_share"]] == pytest.approx(metrics["tuning_macro_ap"], abs=2e-5)
    assert float(fitted["sparse_time.share"]) == metrics["sparse_time_share"]
    # and its L1 penalties are the relaxed lasso's fixed defaults (choosing on the tuning split: sparse_time_c=null)
    rule = {"select_c": 0.05, "bins": "cumulative"}
    assert metrics["sparse_time_c"] == {"c": 0.3, "chosen_on": "fixed (sparse_time_c)", **rule}
    _run(
        "finetune",
        "--data",
        str(d["etl"]),
        "--out",
        str(d["ft"]),
        "--pretrained",
        str(d["pre"]),
        "--resume",
        "last",
        "--max-epochs",
        "2",
        "task.min_label_count=2",
        *FAST_TRAINER,
    )
    assert read_metrics(d["ft"])["steps"] > metrics["steps"]
    resumed = _sparse_time_buffers(d["ft"])  # the fit is deterministic: a resumed run has the same path
    assert all(torch.equal(fitted[name], resumed[name]) for name in fitted)


def _sparse_time_buffers(finetune_dir: Path) -> dict[str, torch.Tensor]:
    state = load_bundle(finetune_dir, "multilabel")["state_dict"]
    return {name: value for name, value in state.items() if name.startswith("sparse_time.")}


@pytest.mark.slow
def test_predict_scores_new_histories_and_reports_what_it_could_not_use(visits_run, tmp_path):
    root, d = visits_run
    new = tmp_path / "new"
    patients = pd.read_csv(root / "cohort" / "patients.csv", dtype=str).head(20)
    events = pd.read_csv(root / "cohort" / "events.csv", dtype=str)
    events = events[events[S.PATIENT_ID].isin(patients[S.PATIENT_ID])].copy()
    events.loc[events.index[0], S.CODE] = "ZZZ9"  # a code never seen in training
    extra = pd.DataFrame({S.PATIENT_ID: ["lonely"], S.BIRTH_DATE: ["1970-01-01"]})  # no events at all
    new.mkdir()
    pd.concat([patients, extra]).to_csv(new / "patients.csv", index=False)
    events.to_csv(new / "events.csv", index=False)
    out = tmp_path / "pred.parquet"
    _run("predict", "--model", str(d["ft"]), "--input", str(new), "--out", str(out), "progress=false")

    pred = pd.read_parquet(out)
    labels = read_metrics(d["ft"])["labels"]
    assert list(pred.columns) == [S.PATIENT_ID, S.PREDICTION_TIME, S.CODE, S.PROBABILITY]
    assert pred[S.PROBABILITY].between(0, 1).all()
    scored = pred[S.PATIENT_ID].nunique()
    assert len(pred) == scored * labels and scored >= 15
    last = events.assign(t=pd.to_datetime(events[S.DATE])).groupby(S.PATIENT_ID)["t"].max()
    times = pred.groupby(S.PATIENT_ID)[S.PREDICTION_TIME].first()
    assert (times == last.reindex(times.index)).all()  # as of each patient's last recorded event

    summary = json.loads((tmp_path / "pred.summary.json").read_text())
    assert summary["unknown_code_events"] >= 1 and "ZZZ" in summary["unknown_codes_top"]
    unscored = pd.read_parquet(tmp_path / "pred.unscored.parquet")
    assert unscored.set_index(S.PATIENT_ID).loc["lonely", S.REASON] == "no_events"

    # MEDS predictions need int64 subject ids: this cohort's ids are text ('P000001'), so layout=meds stops
    argv = ["predict", "--model", str(d["ft"]), "--input", str(new), "--out", str(tmp_path / "m"), "layout=meds"]
    assert main([*argv, "progress=false"]) == 1
    # (tests/test_wild_inputs.py validates MEDS-layout predictions with meds-evaluation)


@pytest.mark.slow
def test_evaluate_on_another_etl_output_names_the_one_the_model_was_trained_on(visits_run, tmp_path, capsys):
    root, d = visits_run
    other = tmp_path / "etl_full_codes"  # the same cohort at full codes: another vocabulary
    _run("etl", "--input", str(root / "cohort"), "--out", str(other), "progress=false")
    argv = ["evaluate", "--model", str(d["ft"]), "--data", str(other), "--out", str(tmp_path / "eval")]
    assert main(argv) == 1
    line = error_line(capsys.readouterr().err)
    assert "was trained on a different vocabulary" in line and f"fine-tuned on (--data {d['etl']})" in line
    assert not (tmp_path / "eval").exists()


def test_commands_fail_with_one_line_messages(tmp_path, capsys):
    assert main(["finetune", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "run `behrt-rope etl` first" in error_line(capsys.readouterr().err)
    argv = ["predict", "--model", str(tmp_path), "--input", str(tmp_path), "--out", str(tmp_path / "p.parquet")]
    assert main(argv) == 1
    assert "not a `behrt-rope finetune` output" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sample", "fmt", "overrides"),
    [("meds-mimic4-demo", "meds", ("etl.code_truncate=3",)), ("omop-synthea27", "omop", ())],
)
def test_real_samples_run_through_every_stage(tmp_path, sample, fmt, overrides):
    raw = SHARED_DATA / sample
    if not raw.is_dir():
        pytest.skip(f"{raw} not present")
    split = ("etl.split.train=0.6", "etl.split.tuning=0.2", "etl.split.held_out=0.2")
    d = _pipeline(tmp_path, raw, fmt, *overrides, *split, evaluate=(GBM_FIXED,))
    manifest = json.loads((d["etl"] / S.MANIFEST_FILE).read_text())
    assert manifest["reconciles"] and manifest["events_used"]["reconciles"]
    out = tmp_path / "pred.parquet"
    _run("predict", "--model", str(d["ft"]), "--input", str(raw), "--out", str(out), "progress=false")
    pred = pd.read_parquet(out)
    assert pred[S.PATIENT_ID].nunique() == manifest["patients"]["with_tokens"]


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory):
    """A cohort with its oracle, ETL at full codes, a tiny model from scratch, evaluated against the oracle."""
    root = tmp_path_factory.mktemp("e2e_oracle")
    cohort, etl, ft, ev = (root / name for name in ("cohort", "etl", "ft", "eval"))
    _run(
        "synth", "--out", str(cohort), "--patients", "400", "--seed", "5", "oracle=true", "oracle_replicas=50",
        "record_oracle=true", "record_oracle_particles=50",
    )  # fmt: skip
    _run("etl", "--input", str(cohort), "--out", str(etl), "progress=false")
    _run("finetune", "--data", str(etl), "--out", str(ft), *FINETUNE_FAST, *TINY_MODEL)
    against = (f"oracle={cohort}", "n_bootstrap=20", GBM_FIXED)
    _run("evaluate", "--model", str(ft), "--data", str(etl), "--out", str(ev), *against)
    return cohort, ev


@pytest.mark.slow
def test_evaluate_against_the_record_oracle(oracle_run, tmp_path):
    """``oracle_record.parquet`` has the state oracle's cuts. Given the cohort directory, evaluate measures
    every predictor against both oracles (``ceiling``, ``ceiling_record``) and the report shows both; given
    the record oracle's file alone, that is the one ceiling. Against the record oracle the gap is measured to
    the best prediction from the record, which ranks below the state oracle's."""
    cohort, ev = oracle_run
    state = pd.read_parquet(cohort / "oracle.parquet")
    record = pd.read_parquet(cohort / "oracle_record.parquet")
    key = ["patient_id", "prediction_time"]
    pd.testing.assert_frame_equal(
        record[key].drop_duplicates(ignore_index=True), state[key].drop_duplicates(ignore_index=True)
    )
    ft = ev.parent / "ft"
    out = tmp_path / "eval_record"
    _run("evaluate", "--model", str(ft), "--data", str(ev.parent / "etl"), "--out", str(out),
         f"oracle={cohort / 'oracle_record.parquet'}", "n_bootstrap=20", GBM_FIXED)  # fmt: skip
    alone, both = read_metrics(out), read_metrics(ev)
    assert alone["ceiling"] is None and alone["ceiling_record"] == both["ceiling_record"]
    on_record, on_state = both["ceiling_record"]["predictors"], both["ceiling"]["predictors"]
    report = (ev / "report.html").read_text()
    assert "Against the ceiling (synthetic data)" in report and "Against the learnable ceiling" in report
    assert "Against the ceiling (synthetic data)" not in (out / "report.html").read_text()
    assert on_record["model"]["overall"] == on_state["model"]["overall"], "same samples, same model scores"
    assert on_record["oracle"]["overall"]["macro_ap"] != on_state["oracle"]["overall"]["macro_ap"]
    lr, ceiling = on_record["logistic_regression"]["overall"]["macro_ap"], on_record["oracle"]["overall"]["macro_ap"]
    expected = (on_record["model"]["overall"]["macro_ap"] - lr) / (ceiling - lr)
    assert on_record["model"]["gap_closed"]["point"] == pytest.approx(expected)


@pytest.mark.slow
def test_evaluate_against_the_oracle(oracle_run):
    _, ev = oracle_run
    ceiling = read_metrics(ev)["ceiling"]
    predictors = ceiling["predictors"]
    assert set(predictors) == {
        "model",
        "logistic_regression",
        "logistic_regression_one_cut",
        "gradient_boosting",
        "sparse_time_regression",
        "model_deep_part",
        "oracle",
    }
    assert 0 < ceiling["n_samples"] == ceiling["n_patients"]  # one cut per held-out patient
    oracle_ap = predictors["oracle"]["overall"]["macro_ap"]
    lr_ap = predictors["logistic_regression"]["overall"]["macro_ap"]
    assert oracle_ap > lr_ap  # the true probabilities rank better than a regression on 320 patients
    assert predictors["logistic_regression"]["gap_closed"]["point"] == pytest.approx(0.0)
    assert predictors["oracle"]["gap_closed"]["point"] == pytest.approx(1.0)
    model = predictors["model"]
    expected = (model["overall"]["macro_ap"] - lr_ap) / (oracle_ap - lr_ap)
    assert model["gap_closed"]["point"] == pytest.approx(expected)
    # The same share measured from the one-cut logistic regression (the classic reference) instead.
    one_cut_ap = predictors["logistic_regression_one_cut"]["overall"]["macro_ap"]
    expected = (model["overall"]["macro_ap"] - one_cut_ap) / (oracle_ap - one_cut_ap)
    assert model["gap_closed_one_cut"]["point"] == pytest.approx(expected)
    assert predictors["logistic_regression_one_cut"]["gap_closed_one_cut"]["point"] == pytest.approx(0.0)
    # Each label code's AP at the cuts, every predictor: their mean over the codes with a positive is macro AP.
    rows = ceiling["per_code"]
    assert len(rows) == len(read_metrics(ev)["model"]["per_code"])
    assert all(set(row["ap"]) == set(predictors) for row in rows)
    for name, entry in predictors.items():
        aps = [row["ap"][name] for row in rows if row["ap"][name] is not None]
        assert np.mean(aps) == pytest.approx(entry["overall"]["macro_ap"]), name
    # Apart on codes already on file and on new onsets: every predictor, anchored at the same two ends.
    parts = ceiling["by_history"]
    assert set(parts) == {"on_file", "new_onset"}
    for part in parts.values():
        assert set(part) == set(predictors)
        assert 0 < part["model"]["n_codes_macro"] <= len(read_metrics(ev)["model"]["per_code"])
        gap = part["oracle"]["macro_ap"] - part["logistic_regression"]["macro_ap"]
        expected = (part["model"]["macro_ap"] - part["logistic_regression"]["macro_ap"]) / gap if gap > 0 else None
        assert part["model"]["gap_closed"]["point"] == pytest.approx(expected)  # None: no gap in that part
    html = (ev / S.REPORT_FILE).read_text()
    assert "Macro AP, new onsets (codes not yet recorded) (95% CI)" in html
    assert "Against the ceiling (synthetic data)" in html and "Oracle (true probabilities)" in html
    assert "Gap closed, one-cut logistic regression to oracle" in html
    assert "Sparse (L1) regression on binned timing of every code" in html
    assert "Deep part of the model alone (encoder and head; no sparse time path, no chains)" in html


@pytest.mark.slow
def test_demo_headline_names_every_reference_and_both_gap_shares(visits_run, oracle_run, tmp_path):
    """The summary `make demo` prints: one column per reference model the evaluation wrote (a new reference
    once broke it), and per predictor at the oracle's cuts the gap closed from both logistic regressions."""
    from pipelines.demo import ceiling_lines, headline

    _, d = visits_run
    for stage_name, source in (("evaluate", d["eval"]), ("pretrain", d["pre"]), ("etl", d["etl"])):
        (tmp_path / stage_name).symlink_to(source)
    text = headline(tmp_path)
    assert all(name in text for name in ("LogReg", "LogReg1cut", "GradBoost", "SparseTime", "DeepPart"))
    assert f"{read_metrics(d['eval'])['model']['overall']['macro_ap']:.4f}" in text
    _, ev = oracle_run
    ceiling = read_metrics(ev)["ceiling"]
    lines = ceiling_lines(ceiling)
    model = ceiling["predictors"]["model"]
    shares = [f"{100 * model[key]['point']:.0f}%" for key in ("gap_closed", "gap_closed_one_cut")]
    parts = ceiling["by_history"]
    split = " / ".join(format_share(parts[p]["model"]["gap_closed"], ci=False, missing="n/a") for p in parts)
    model_line = next(line for line in lines if line.strip().startswith("BEHRT-RoPE"))
    assert " / ".join(shares) in model_line and model_line.endswith(f"({split})")  # on file / new onsets
    assert len(lines) == 1 + len(ceiling["predictors"]) and ceiling_lines(None) == []


@pytest.mark.slow
def test_oracle_refused_when_the_etl_merges_its_codes(oracle_run, visits_run, capsys):
    """Cut to 3 characters, two catalogue codes of E11 become one token: the oracle has no probability for
    "either", so evaluation stops with the reason rather than report a false ceiling."""
    cohort, _ = oracle_run
    root, d = visits_run
    argv = ["evaluate", "--model", str(d["ft"]), "--data", str(d["etl"]), "--out", str(root / "ev_oracle")]
    assert main([*argv, f"oracle={cohort}", "n_bootstrap=5", "gradient_boosting=false"]) != 0
    assert "become one token" in capsys.readouterr().err
    assert not (root / "ev_oracle" / S.DONE_MARKER).exists()


@pytest.mark.slow
def test_a_window_task_runs_through_every_stage_and_refuses_the_next_visit_oracle(oracle_run, tmp_path, capsys):
    """``--task 12m``: the labels are the codes recorded within a year after the prediction visit, and the
    model, every reference and the report are of that task. The oracle gives next-visit probabilities, so
    evaluate refuses it for such a model rather than report a ceiling of another task."""
    cohort, ev = oracle_run
    etl, ft, out = ev.parent / "etl", tmp_path / "ft_12m", tmp_path / "ev_12m"
    _run("finetune", "--data", str(etl), "--out", str(ft), "--task", "12m", *FINETUNE_FAST, *TINY_MODEL)
    assert load_bundle(ft, "multilabel")["task"]["name"] == "12m"
    argv = ["evaluate", "--model", str(ft), "--data", str(etl), "--out", str(out), "n_bootstrap=5", GBM_FIXED]
    assert main([*argv, f"oracle={cohort}"]) == 1
    assert "predicts the 12m task, so no ceiling exists" in error_line(capsys.readouterr().err)
    assert not (out / S.DONE_MARKER).exists()
    _run(*argv)
    window, next_visit = read_metrics(out), read_metrics(ev)
    assert window["task"] == "12m" and window["ceiling"] is None
    assert set(window["baselines"]) == set(next_visit["baselines"])
    # a year holds more visits than one: more codes per sample; it needs a year of follow-up: fewer samples
    assert window["model"]["overall"]["label_cardinality"] > next_visit["model"]["overall"]["label_cardinality"]
    assert window["model"]["n_samples"] < next_visit["model"]["n_samples"]
    assert "Diagnoses recorded within 12 months" in (out / S.REPORT_FILE).read_text()


@pytest.mark.slow
def test_finetune_takes_head_and_dropout_from_its_own_settings_and_refuses_a_clashing_encoder(visits_run):
    from behrt_rope import config as config_lib
    from behrt_rope.errors import UserError
    from pipelines.finetune import Config, _encoder_start

    _, d = visits_run
    tokens = pd.read_parquet(d["etl"] / S.VOCAB_FILE)["token"].tolist()

    def start(*overrides: str):
        config = config_lib.build(Config, {"data": str(d["etl"]), "pretrained": str(d["pre"])}, list(overrides))
        return _encoder_start(config, tokens)

    model, weights = start("model.dropout=0.0", "model.label_attention_heads=3", *TINY_MODEL)
    assert weights is not None
    assert model.dropout == 0.0 and model.label_attention_heads == 3  # this run's, not the bundle's
    pretrained = json.loads((d["pre"] / S.MODEL_META_FILE).read_text())
    assert model.hidden_size == pretrained["model_config"]["hidden_size"]  # the encoder's, from the bundle
    with pytest.raises(UserError, match=r"model.num_layers=7 differs from the pre-trained encoder's num_layers"):
        start("model.num_layers=7")
