"""``predict`` streams the input by patient shard: same predictions however many shards, one row group per
shard, and bf16 scoring that barely moves the rankings."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from scipy.stats import spearmanr

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.errors import UserError
from tests.fixtures_training import build_finetuned, error_line


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_finetuned(tmp_path_factory.mktemp("predict"), patients=160, seed=2)


def predict(raw, model_dir, out, *overrides):
    argv = ["predict", "--model", str(model_dir), "--input", str(raw), "--out", str(out), "progress=false"]
    assert main([*argv, *overrides]) == 0
    return pd.read_parquet(out).sort_values([S.PATIENT_ID, S.CODE], ignore_index=True)


def summary(out):
    return json.loads(out.with_suffix(".summary.json").read_text())


@pytest.mark.slow
def test_sharded_predictions_equal_unsharded_and_stream_as_row_groups(model, tmp_path):
    raw, model_dir = model
    one = predict(raw, model_dir, tmp_path / "one.parquet", "shards=1", "precision=fp32")
    three = predict(raw, model_dir, tmp_path / "three.parquet", "shards=3", "precision=fp32")
    assert pq.ParquetFile(tmp_path / "one.parquet").num_row_groups == 1
    assert pq.ParquetFile(tmp_path / "three.parquet").num_row_groups == 3  # one per shard: never all in memory
    pd.testing.assert_frame_equal(one.drop(columns=S.PROBABILITY), three.drop(columns=S.PROBABILITY))
    np.testing.assert_allclose(one[S.PROBABILITY], three[S.PROBABILITY], atol=1e-6, rtol=0)
    a, b = summary(tmp_path / "one.parquet"), summary(tmp_path / "three.parquet")
    assert b["shards"] == 3 and a["patients_scored"] == b["patients_scored"] == one[S.PATIENT_ID].nunique()
    for key in ("patients_not_scored", "unknown_code_events", "rows_quarantined"):
        assert a[key] == b[key]


@pytest.mark.slow
def test_the_input_is_planned_once_however_many_shards(model, tmp_path, monkeypatch):
    """Schema checks and reference tables are per input, not per shard: a 4-shard run plans once."""
    from behrt_rope.etl.readers import visits

    calls = []
    real_plan = visits.plan
    monkeypatch.setattr(visits, "plan", lambda *args: calls.append(args) or real_plan(*args))
    raw, model_dir = model
    predict(raw, model_dir, tmp_path / "p.parquet", "shards=4", "precision=fp32")
    assert len(calls) == 1 and summary(tmp_path / "p.parquet")["shards"] == 4


@pytest.mark.slow
def test_shards_default_to_the_input_size(model, tmp_path):
    raw, model_dir = model
    predict(raw, model_dir, tmp_path / "p.parquet", "shard_rows=2000")
    rows = sum(1 for path in raw.iterdir() for _ in path.open()) - 2  # minus the two header lines
    assert summary(tmp_path / "p.parquet")["shards"] == pytest.approx(rows / 2000, abs=2)


@pytest.mark.slow
def test_bf16_scoring_barely_moves_the_rankings(model, tmp_path):
    raw, model_dir = model
    fp32 = predict(raw, model_dir, tmp_path / "fp32.parquet", "precision=fp32")
    bf16 = predict(raw, model_dir, tmp_path / "bf16.parquet", "precision=bf16")
    assert (fp32[S.PATIENT_ID] == bf16[S.PATIENT_ID]).all() and (fp32[S.CODE] == bf16[S.CODE]).all()
    diff = (fp32[S.PROBABILITY] - bf16[S.PROBABILITY]).abs()
    assert diff.max() < 0.02
    wide32 = fp32.pivot(index=S.PATIENT_ID, columns=S.CODE, values=S.PROBABILITY)
    wide16 = bf16.pivot(index=S.PATIENT_ID, columns=S.CODE, values=S.PROBABILITY)
    rho = [spearmanr(wide32[c], wide16[c]).statistic for c in wide32.columns if wide32[c].std() > 0]
    assert np.median(rho) > 0.98 and min(rho) > 0.9, rho


@pytest.mark.slow
def test_a_shard_is_written_while_the_next_is_scored_and_the_file_equals_sequential_scoring(
    model, tmp_path, monkeypatch
):
    """Shard k's predictions are laid out and written in a thread while shard k+1 is scored; the writes still
    come from one thread in shard order, and each row group equals scoring the shards one after another."""
    import threading

    import torch

    from behrt_rope.etl.readers import ShardSource
    from behrt_rope.scoring.scorer import Scorer
    from behrt_rope.scoring.shard import prepare_shard
    from behrt_rope.training.bundle import load_bundle
    from behrt_rope.training.inference import multilabel_model
    from pipelines import predict as pipeline

    raw, model_dir = model
    second_scored, writers, overlapped = threading.Event(), [], []
    real_score, real_write = Scorer.score, pipeline._ParquetSink.write

    def score(self, seqs):
        second_scored.set() if getattr(self, "calls", 0) == 1 else None
        self.calls = getattr(self, "calls", 0) + 1
        return real_score(self, seqs)

    def write(self, table):
        if not writers:  # the first shard's write waits until the second shard is being scored
            overlapped.append(second_scored.wait(timeout=60))
        writers.append(threading.get_ident())
        real_write(self, table)

    monkeypatch.setattr(Scorer, "score", score)
    monkeypatch.setattr(pipeline._ParquetSink, "write", write)
    out = tmp_path / "p.parquet"
    predict(raw, model_dir, out, "shards=3", "precision=fp32", "device=cpu")  # the CPU scorer below is the reference
    monkeypatch.undo()
    assert overlapped == [True] and len(writers) == 3 and len(set(writers)) == 1

    bundle = load_bundle(model_dir, "multilabel")
    etl = pipeline._etl_config(bundle, "", None)
    vocab = pd.DataFrame({"token_id": np.arange(len(bundle["vocab"]), dtype=np.int32), "token": bundle["vocab"]})
    job = pipeline.Job(str(model_dir), str(raw), etl, vocab, list(bundle["labels"]), "", 3)
    scorer = Scorer(multilabel_model(bundle), torch.device("cpu"), "fp32")
    src = ShardSource.open(raw, etl)
    written = pq.ParquetFile(out)
    for shard in range(3):
        expected = pipeline.score_prepared(job, prepare_shard(src, vocab, shard, 3), scorer)
        assert written.read_row_group(shard).equals(expected)


def test_new_histories_are_thinned_as_the_model_s_etl_thinned_its_own(visits_dir):
    """``predict`` lays new histories out with the model's ETL settings, first-record thinning included."""
    from behrt_rope.etl.readers import ShardSource
    from behrt_rope.scoring.shard import prepare_shard
    from pipelines import predict as pipeline

    bundle = {"etl_settings": {"etl": {"max_seq_len": 12, "keep_first_records": True}}}
    etl = pipeline._etl_config(bundle, "", None)
    assert etl.keep_first_records and etl.max_seq_len == 12
    visits = [("2010-01-01", "A01 B01"), ("2011-01-01", "A01 C01"), ("2012-01-01", "A01"), ("2013-01-01", "A01 D01")]
    events = [
        {"patient_id": "p1", "date": day, "code": code}
        for day, codes in [*visits, ("2014-01-01", "E01")]
        for code in codes.split()
    ]
    raw = visits_dir([{"patient_id": "p1", "birth_date": "2000-01-01"}], events)
    vocab = pd.DataFrame(
        {"token_id": np.arange(10, dtype=np.int32), "token": [*S.SPECIAL_TOKENS, "A01", "B01", "C01", "D01", "E01"]}
    )
    seqs = prepare_shard(ShardSource.open(raw, etl), vocab, 0, 1).seqs
    assert seqs.token_ids.tolist() == [S.CLS_ID, 5, 6, S.SEP_ID, 7, S.SEP_ID, 5, 8, S.SEP_ID, 9, S.SEP_ID]
    assert seqs.thinned_visits.tolist() == [2]


def _refusal(capsys, model_dir, raw, out) -> str:
    argv = ["predict", "--model", str(model_dir), "--input", str(raw), "--out", str(out), "progress=false"]
    assert main(argv) == 1
    return error_line(capsys.readouterr().err)


def test_out_never_replaces_a_folder_the_input_or_the_model(tmp_path, capsys):
    """``predict`` removes ``--out`` whole before writing: a folder that is no earlier predictions output, the
    input or the model given as ``--out`` is refused untouched (it used to be deleted), and so is a .csv name."""
    raw, model_dir, results = tmp_path / "new", tmp_path / "ft", tmp_path / "results"
    for folder in (raw, model_dir, results):
        folder.mkdir()
        (folder / "keep.parquet").write_text("x")
    assert "not a previous predictions output" in _refusal(capsys, model_dir, raw, results)
    assert "would replace --input" in _refusal(capsys, model_dir, raw, raw)
    assert "would replace --input" in _refusal(capsys, model_dir, raw, tmp_path)  # a folder holding it
    assert "would replace --input" in _refusal(capsys, model_dir, raw, raw / "keep.parquet")
    assert "would replace --model" in _refusal(capsys, model_dir, raw, model_dir)
    assert "name the file *.parquet, not .csv" in _refusal(capsys, model_dir, raw, tmp_path / "risks.csv")
    assert all((folder / "keep.parquet").read_text() == "x" for folder in (raw, model_dir, results))


def test_an_earlier_predictions_output_is_still_replaced(tmp_path):
    """What a run wrote (a file, or a folder of parts with engine=ray) is replaced by the next run."""
    from pipelines import predict as pipeline

    config = pipeline.Config(model=str(tmp_path / "ft"), input=str(tmp_path / "new"), out="")
    parts, single = tmp_path / "ray.parquet", tmp_path / "p.parquet"
    parts.mkdir()
    (parts / "part-00000.parquet").write_bytes(b"")
    single.write_bytes(b"")
    for out in (parts, single):
        out.with_suffix(".summary.json").write_text("{}")
        pipeline.check_out(out, config)  # no error
    (parts / "notes.txt").write_text("mine")  # not a predictions folder any more
    with pytest.raises(UserError, match="not a previous predictions output"):
        pipeline.check_out(parts, config)


@pytest.mark.slow
def test_a_model_that_cannot_be_loaded_leaves_the_earlier_predictions(model, tmp_path, capsys):
    """predict replaces its earlier output, so a model whose weights do not fit its description stops before
    that output is touched: the earlier predictions and their summary are still there, unchanged."""
    raw, model_dir = model
    broken = tmp_path / "ft"
    shutil.copytree(model_dir, broken)
    out = tmp_path / "risks.parquet"
    before = predict(raw, broken, out)
    meta = json.loads((broken / S.MODEL_META_FILE).read_text())
    meta["model_config"]["hidden_size"] *= 2
    (broken / S.MODEL_META_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    argv = ["predict", "--model", str(broken), "--input", str(raw), "--out", str(out), "progress=false"]
    assert main(argv) != 0
    assert "does not fit the model" in error_line(capsys.readouterr().err)
    after = pd.read_parquet(out).sort_values([S.PATIENT_ID, S.CODE], ignore_index=True)
    pd.testing.assert_frame_equal(after, before)
    assert out.with_suffix(".summary.json").exists()


@pytest.mark.slow
def test_nothing_scored_stops_with_the_reasons_and_writes_no_predictions(model, tmp_path, capsys):
    """Events whose ids match no patient (text ids against integers) score nobody: an error naming the
    reasons and the sidecars, not an empty predictions file and exit status 0."""
    raw, model_dir = model
    new = tmp_path / "new"
    new.mkdir()
    patients = pd.read_csv(raw / "patients.csv", dtype=str).head(5)
    events = pd.read_csv(raw / "events.csv", dtype=str)
    events = events[events[S.PATIENT_ID].isin(patients[S.PATIENT_ID])]
    patients.assign(patient_id=range(5)).to_csv(new / "patients.csv", index=False)
    events.to_csv(new / "events.csv", index=False)
    out = tmp_path / "p.parquet"
    line = _refusal(capsys, model_dir, new, out)
    assert "no patient could be scored: 10 patient(s)" in line and "unknown_patient (5)" in line
    assert "no_events (5)" in line and str(tmp_path / "p.unscored.parquet") in line
    assert not out.exists() and summary(out)["patients_scored"] == 0
    assert summary(out)["rows_quarantined"] == {"unknown_patient": len(events)}


@pytest.mark.slow
def test_the_summary_reconciles_every_input_row_and_counts_the_truncated_history(model, tmp_path):
    """Rows read = used + quarantined + duplicates dropped + filtered per input file, as in the ETL manifest,
    and the events the model's max_seq_len cut from a long history are counted, not lost silently."""
    _, model_dir = model
    days = pd.date_range("2000-01-01", periods=300, freq="7D").strftime("%Y-%m-%d")
    events = pd.DataFrame({S.PATIENT_ID: "long", S.DATE: np.repeat(days, 2), S.CODE: ["I10", "E119"] * 300})
    bad = pd.DataFrame({S.PATIENT_ID: ["long", "ghost"], S.DATE: ["1950-01-01", "2001-01-01"], S.CODE: ["I10"] * 2})
    new = tmp_path / "new"
    new.mkdir()
    pd.DataFrame({S.PATIENT_ID: ["long"], S.BIRTH_DATE: ["1960-01-01"]}).to_csv(new / "patients.csv", index=False)
    pd.concat([events, events.head(3), bad]).to_csv(new / "events.csv", index=False)
    predict(new, model_dir, tmp_path / "p.parquet")
    got = summary(tmp_path / "p.parquet")
    assert got["input_rows"]["events.csv"] == {
        "rows": 605,
        "used": 600,
        "quarantined": 2,  # before birth, unknown patient
        "duplicates_dropped": 3,
        "filtered": 0,
        "reconciles": True,
    }
    assert got["truncation"]["patients_truncated"] == 1 and got["truncation"]["max_seq_len"] == 512
    assert got["code_events"] + got["truncation"]["events_dropped"] == 600 and got["code_events"] < 512


def _few_patients(raw, folder, n=20, codes=lambda c: c, extra=None):
    """The first ``n`` patients of the cohort in ``raw`` as a new visits-format input in ``folder``, their codes
    passed through ``codes``, with ``extra`` event rows added."""
    folder.mkdir()
    patients = pd.read_csv(raw / "patients.csv", dtype=str).head(n)
    events = pd.read_csv(raw / "events.csv", dtype=str)
    events = events[events[S.PATIENT_ID].isin(patients[S.PATIENT_ID])].assign(code=lambda e: e[S.CODE].map(codes))
    patients.to_csv(folder / "patients.csv", index=False)
    pd.concat([events, pd.DataFrame(extra or [])]).to_csv(folder / "events.csv", index=False)
    return folder


def _meds_copy(raw, folder, n=20):
    """The first ``n`` patients of the visits cohort in ``raw`` as MEDS, codes named ``ICD10CM/code``."""
    from tests.test_meds import write_meds

    patients = pd.read_csv(raw / "patients.csv", dtype=str).head(n)
    events = pd.read_csv(raw / "events.csv", dtype=str)
    number = {pid: i for i, pid in enumerate(patients[S.PATIENT_ID])}
    rows = [(number[p], b, "MEDS_BIRTH") for p, b in zip(patients[S.PATIENT_ID], patients[S.BIRTH_DATE])]
    rows += [
        (number[p], b, f"GENDER//{x}")
        for p, b, x in zip(patients[S.PATIENT_ID], patients[S.BIRTH_DATE], patients[S.SEX])
    ]
    events = events[events[S.PATIENT_ID].isin(number)]
    rows += [(number[p], d, f"ICD10CM/{c}") for p, d, c in zip(events[S.PATIENT_ID], events[S.DATE], events[S.CODE])]
    return write_meds(folder, rows)


@pytest.mark.slow
def test_a_format_other_than_the_model_s_is_named_in_the_error_the_warning_and_the_summary(
    model, tmp_path, capsys, caplog
):
    """Another --format than the model was trained on may be right (the same codes in MEDS), so it is not
    refused; but when it fails, or leaves codes unknown, the error, the warning and the summary name both."""
    raw, model_dir = model
    argv = ["predict", "--model", str(model_dir), "--input", str(raw), "--out", str(tmp_path / "a.parquet")]
    assert main([*argv, "--format", "meds", "progress=false"]) == 1
    line = error_line(capsys.readouterr().err)
    assert "no MEDS event files" in line and "--format meds, the model was trained on --format visits" in line
    out = tmp_path / "b.parquet"
    predict(_meds_copy(raw, tmp_path / "meds"), model_dir, out, "--format", "meds")
    got = summary(out)
    assert (got["input_format"], got["training_format"], got["format_differs"]) == ("meds", "visits", True)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "100% of code events have codes the model never saw" in warned and "trained on --format visits" in warned
    same = tmp_path / "c.parquet"
    predict(_few_patients(raw, tmp_path / "visits"), model_dir, same, "--format", "visits")
    assert summary(same)["format_differs"] is False


def _by_patient(predictions, ids=None):
    """Probabilities (patients, label codes), rows in patient order; ``ids`` renames the patients first."""
    frame = predictions.assign(**({S.PATIENT_ID: predictions[S.PATIENT_ID].map(ids)} if ids else {}))
    return frame.pivot(index=S.PATIENT_ID, columns=S.CODE, values=S.PROBABILITY).sort_index()


@pytest.mark.slow
def test_codes_named_with_a_vocabulary_prefix_the_model_lacks_are_reported_and_matched_on_request(
    model, tmp_path, caplog
):
    """A model trained on bare visits codes (E119) sees MEDS codes as ICD10CM/E119: every code is unknown. The
    summary and the warning say that match_codes=vocabulary_prefix would match them; with it, the MEDS copy
    scores as the visits original does."""
    raw, model_dir = model
    meds = _meds_copy(raw, tmp_path / "meds")
    plain = predict(meds, model_dir, tmp_path / "plain.parquet", "--format", "meds", "precision=fp32")
    got = summary(tmp_path / "plain.parquet")
    assert got["unknown_code_events"] == got["code_events"] > 0
    assert got["unknown_would_match"] == {"vocabulary_prefix": got["code_events"]}
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "would match the model's codes with match_codes=vocabulary_prefix (ICD10CM/" in warned
    out = tmp_path / "matched.parquet"
    matched = predict(meds, model_dir, out, "--format", "meds", "precision=fp32", "match_codes=vocabulary_prefix")
    got = summary(out)
    assert (got["unknown_code_events"], got["matched_code_events"]) == (0, got["code_events"])
    assert got["match_codes"] == ["vocabulary_prefix"] and got["unknown_would_match"] == {}
    assert all(key.startswith("ICD10CM/") and " -> " in key for key in got["matched_codes_top"])
    original = predict(_few_patients(raw, tmp_path / "visits"), model_dir, tmp_path / "v.parquet", "precision=fp32")
    ids = dict(enumerate(sorted(original[S.PATIENT_ID].unique())))
    np.testing.assert_allclose(_by_patient(matched, ids), _by_patient(original), atol=1e-6)
    assert not np.allclose(_by_patient(plain, ids), _by_patient(original), atol=1e-3)


@pytest.mark.slow
def test_lower_case_codes_are_not_folded_unasked_but_reported_and_matched_with_match_codes_case(
    model, tmp_path, caplog
):
    """Codes are case-sensitive by default (Read codes are): lower-case copies of the model's codes stay
    unknown, but the summary counts them under unknown_would_match["case"] and the warning names
    match_codes=case; with it, a history holding each code in both cases scores as the original."""
    raw, model_dir = model
    original = predict(_few_patients(raw, tmp_path / "visits"), model_dir, tmp_path / "v.parquet", "precision=fp32")
    events = pd.read_csv(tmp_path / "visits" / "events.csv", dtype=str)
    lower = _few_patients(raw, tmp_path / "lower", codes=str.lower)
    plain = predict(lower, model_dir, tmp_path / "plain.parquet", "precision=fp32")
    got = summary(tmp_path / "plain.parquet")
    assert got["unknown_would_match"] == {"case": got["unknown_code_events"]} and got["unknown_code_events"] > 0
    assert "with match_codes=case" in " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert not np.allclose(_by_patient(plain), _by_patient(original), atol=1e-3)
    both = _few_patients(raw, tmp_path / "both", codes=str.lower, extra=events.to_dict("records"))
    matched = predict(both, model_dir, tmp_path / "matched.parquet", "precision=fp32", "match_codes=case")
    got = summary(tmp_path / "matched.parquet")
    assert got["unknown_code_events"] == 0 and got["matched_code_events"] == got["code_events"] // 2
    np.testing.assert_allclose(_by_patient(matched), _by_patient(original), atol=1e-6)


@pytest.mark.slow
def test_events_after_the_as_of_day_are_set_aside_counted_and_never_become_the_prediction_time(model, tmp_path, capsys):
    """An event dated in the future (2099 in a record of the 2010s) used to become the patient's prediction time.
    By default events after the run date are quarantined (event_after_as_of) and the summary still reconciles;
    a record wholly in the future (date-shifted, as MIMIC's) is kept. --as-of cuts every history at a day."""
    raw, model_dir = model
    original = predict(_few_patients(raw, tmp_path / "visits"), model_dir, tmp_path / "v.parquet", "precision=fp32")
    events = pd.read_csv(tmp_path / "visits" / "events.csv", dtype=str)
    first = events[S.PATIENT_ID].iloc[0]
    typo = {S.PATIENT_ID: first, S.DATE: "2099-01-01", S.CODE: events[S.CODE].iloc[0], "visit_id": "typo"}
    shifted = _few_patients(raw, tmp_path / "typo", extra=[typo])
    out = tmp_path / "typo.parquet"
    got_typo = predict(shifted, model_dir, out, "precision=fp32")
    pd.testing.assert_frame_equal(got_typo, original)
    got = summary(out)
    assert got["events_after_as_of"] == 1 and got["as_of_source"] == "run date"
    assert got["rows_quarantined"] == {"event_after_as_of": 1} and got["input_rows"]["events.csv"]["reconciles"]
    assert got["input_rows"]["events.csv"]["quarantined"] == 1

    patients = pd.read_csv(tmp_path / "visits" / "patients.csv", dtype=str)
    future = patients[S.PATIENT_ID] == first  # the whole record 150 years on, birth included

    def plus(dates: pd.Series) -> pd.Series:
        return (pd.to_datetime(dates) + pd.DateOffset(years=150)).dt.strftime("%Y-%m-%d")

    patients.loc[future, S.BIRTH_DATE] = plus(patients.loc[future, S.BIRTH_DATE])
    mine = events[S.PATIENT_ID] == first
    events.loc[mine, S.DATE] = plus(events.loc[mine, S.DATE])
    whole = tmp_path / "whole"
    whole.mkdir()
    patients.to_csv(whole / "patients.csv", index=False)
    events.to_csv(whole / "events.csv", index=False)
    kept = predict(whole, model_dir, tmp_path / "whole.parquet", "precision=fp32")
    assert summary(tmp_path / "whole.parquet")["events_after_as_of"] == 0
    assert kept[kept[S.PATIENT_ID] == first][S.PREDICTION_TIME].min().year > 2150

    cut = predict(_few_patients(raw, tmp_path / "cut"), model_dir, tmp_path / "cut.parquet", "--as-of", "2016-06-30")
    got = summary(tmp_path / "cut.parquet")
    late = pd.to_datetime(pd.read_csv(tmp_path / "cut" / "events.csv")[S.DATE]) > "2016-06-30"
    assert got["as_of"] == "2016-06-30" and got["events_after_as_of"] == late.sum() > 0
    assert cut[S.PREDICTION_TIME].max() <= pd.Timestamp("2016-06-30") and got["input_rows"]["events.csv"]["reconciles"]
    assert set(got["not_scored_reasons"]) <= {"event_after_as_of"}
    argv = ["predict", "--model", str(model_dir), "--input", str(raw), "--out", str(tmp_path / "x.parquet")]
    assert main([*argv, "--as-of", "30/06/2016"]) == 1
    assert "as_of must be an ISO date such as 2024-06-30, got '30/06/2016'" in error_line(capsys.readouterr().err)
