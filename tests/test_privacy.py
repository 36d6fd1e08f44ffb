"""Privacy (issue 11, item 7): no patient identifier or row-level date-with-code in any text output.

A small cohort with distinctive patient ids (and a few rows the ETL quarantines, and a code unseen in
training at predict time) runs through every stage. Then every text output (logs, ``run.log``, manifests,
metrics, configs, summaries, the model description, the HTML report) and everything printed on the console
is searched for every input patient id, every birth date, and every (event date, code) pair on one line.
Row-level data may appear only in the Parquet files (tokens, quarantine, predictions), as documented.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pandas as pd
import pytest
from fixtures_training import FAST_TRAINER, TINY_MODEL, write_cohort

from behrt_rope import schema as S
from behrt_rope.cli import main

ROW_LEVEL_SUFFIXES = (".parquet", ".safetensors", ".ckpt", ".png")
"""Binary files: Parquet (tokens, quarantine, predictions: row-level by design), weights, checkpoints, plots."""
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

pytestmark = pytest.mark.slow


def distinctive_cohort(folder: Path) -> tuple[list[str], pd.DataFrame, pd.DataFrame]:
    """A synthetic cohort whose ids (``zq7-<n>-pid``) cannot occur by chance, plus two bad rows."""
    write_cohort(folder, patients=100, seed=3)
    patients = pd.read_csv(folder / f"{S.PATIENTS_TABLE}.csv", dtype=str)
    events = pd.read_csv(folder / f"{S.EVENTS_TABLE}.csv", dtype=str)
    ids = {old: f"zq7-{i}-pid" for i, old in enumerate(patients[S.PATIENT_ID])}
    patients[S.PATIENT_ID] = patients[S.PATIENT_ID].map(ids)
    events[S.PATIENT_ID] = events[S.PATIENT_ID].map(ids)
    bad = events.iloc[:2].copy()
    bad[S.DATE] = ["not-a-date", "2020-02-30"]  # quarantined, with the patient id in the quarantine file
    events = pd.concat([events, bad], ignore_index=True)
    patients.to_csv(folder / f"{S.PATIENTS_TABLE}.csv", index=False)
    events.to_csv(folder / f"{S.EVENTS_TABLE}.csv", index=False)
    return list(ids.values()), patients, events


def text_outputs(roots: list[Path]) -> dict[Path, str]:
    found = {}
    for root in roots:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            if not path.name.endswith(ROW_LEVEL_SUFFIXES):
                found[path] = path.read_text(errors="replace")
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """Every stage on the distinctive cohort; (ids, patients, events, {output name: text})."""
    root = tmp_path_factory.mktemp("privacy")
    ids, patients, events = distinctive_cohort(root / "raw")
    etl, pre, ft, ev, pred = (root / n for n in ("etl", "pre", "ft", "eval", "pred.parquet"))
    console: list[str] = []
    commands = [
        ["etl", "--input", str(root / "raw"), "--out", str(etl), "progress=false"],
        ["pretrain", "--data", str(etl), "--out", str(pre), "--max-epochs", "1", *TINY_MODEL, *FAST_TRAINER],
        ["finetune", "--data", str(etl), "--out", str(ft), "--pretrained", str(pre), "--max-epochs", "1"],
        ["predict", "--model", str(ft), "--input", str(root / "raw"), "--out", str(pred), "progress=false"],
        [
            "evaluate",
            "--model",
            str(ft),
            "--data",
            str(etl),
            "--out",
            str(ev),
            "n_bootstrap=5",
            "gradient_boosting=false",
            "progress=false",
        ],
    ]
    commands[2] += ["task.min_label_count=2", *FAST_TRAINER]
    for argv in commands:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
        console.append(out.getvalue() + err.getvalue())
        assert status == 0, err.getvalue()[-2000:]
    outputs = {str(p.relative_to(root)): text for p, text in text_outputs([etl, pre, ft, ev]).items()}
    outputs.update({str(p.relative_to(root)): t for p, t in text_outputs(list(root.glob("pred.*"))).items()})
    outputs["console"] = "\n".join(console)
    assert pd.read_parquet(etl / S.QUARANTINE_FILE)[S.PATIENT_ID].isin(ids).sum() == 2  # the check can see ids
    return ids, patients, events, outputs


def test_every_stage_wrote_text_outputs(run) -> None:
    _, _, _, outputs = run
    names = set(outputs)
    for expected in ("etl/run.log", "etl/manifest.json", "pre/metrics.json", "ft/model.json", "eval/report.html"):
        assert expected in names
    assert "pred.summary.json" in names and "console" in names


def test_no_patient_id_in_any_text_output(run) -> None:
    ids, _, _, outputs = run
    pattern = re.compile("|".join(re.escape(i) for i in ids))
    leaks = {name: pattern.findall(text)[:3] for name, text in outputs.items() if pattern.search(text)}
    assert not leaks


def test_no_birth_date_and_no_event_date_with_its_code(run) -> None:
    _, patients, events, outputs = run
    births = set(patients[S.BIRTH_DATE])
    codes_on = events.groupby(events[S.DATE].str[:10])[S.CODE].agg(set).to_dict()
    leaks = []
    for name, text in outputs.items():
        for line in text.splitlines():
            for date in DATE.findall(line):
                if date in births or any(code in line for code in codes_on.get(date, ())):
                    leaks.append((name, line[:200]))
    assert not leaks, leaks[:5]
