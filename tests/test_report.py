"""evaluate_scores output and the self-contained HTML report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from behrt_rope import schema
from behrt_rope.evaluation.evaluate import evaluate_scores, to_jsonable, write_evaluation_report
from behrt_rope.evaluation.metrics import summary_metrics
from behrt_rope.evaluation.report import ReportInputs, fmt, paired_difference, write_report


@pytest.fixture(scope="module")
def evaluations() -> tuple[dict, dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n, n_codes = 250, 8
    history = rng.random((n, n_codes)) < 0.2
    y = rng.random((n, n_codes)) < 0.1 + 0.4 * history
    model = np.clip(0.35 * y + 0.2 * history + 0.5 * rng.random((n, n_codes)), 0, 1)
    base = np.clip(0.15 * y + 0.3 * history + 0.6 * rng.random((n, n_codes)), 0, 1)
    codes = [f"E1{j}" for j in range(n_codes)]
    m = evaluate_scores(y, model, history, codes, n_bootstrap=40, seed=0)
    b = evaluate_scores(y, base, history, codes, n_bootstrap=40, seed=0)
    return m, b, y, model


def test_evaluate_scores_is_json_and_consistent(evaluations: tuple) -> None:
    m, _, y, model = evaluations
    json.dumps(m, allow_nan=False)
    assert m["overall"]["macro_ap"] == pytest.approx(summary_metrics(y, model)["macro_ap"])
    low, high = m["overall"]["ci"]["macro_ap"]
    assert low <= m["overall"]["macro_ap"] <= high
    assert m["new_onset"]["n_pairs"] < m["overall"]["n_pairs"]
    assert len(m["bootstrap"]["overall"]["micro_ap"]) == 40
    assert sorted(r[schema.CODE] for r in m["per_code"]) == [f"E1{j}" for j in range(8)]
    prevalence = [r["prevalence"] for r in m["per_code"]]
    assert prevalence == sorted(prevalence, reverse=True)
    assert {"new_onset_ap", "ap_low", "prevalence"} <= set(m["per_code"][0])
    assert set(m["calibration"]) == {"uniform", "quantile"} and "precision@5" in m["at_k"]
    assert 0 < m["repeat_share"] < 1
    assert len(m["curves"]["pr"]["recall"]) <= 210


def test_to_jsonable() -> None:
    out = to_jsonable({"a": np.float32(np.nan), "b": (np.int64(2), np.array([1.5, np.inf])), 3: np.bool_(True)})
    assert out == {"a": None, "b": [2, [1.5, None]], "3": True}


def test_paired_difference(evaluations: tuple) -> None:
    m, b, _, _ = evaluations
    result = paired_difference(m, b, "macro_ap")
    assert result is not None
    diff, low, high = result
    assert diff == pytest.approx(m["overall"]["macro_ap"] - b["overall"]["macro_ap"])
    assert low <= high
    assert paired_difference(m, {**b, "pairing_key": "other"}, "macro_ap") is None


def test_report_is_self_contained_and_escaped(evaluations: tuple, tmp_path: Path) -> None:
    m, b, _, _ = evaluations
    path = write_evaluation_report(
        tmp_path,
        "BEHRT <script>alert(1)</script>",
        "Next visit & beyond",
        m,
        b,
        n_patients=99,
        pretrain_metrics={"mlm_accuracy": 0.4321},
        run_info={"config": "a<b"},
        notes=["Synthetic data: not real patients"],
        code_descriptions={"E10": "Type 1 <diabetes>"},
    )
    text = path.read_text()
    assert path == tmp_path / schema.REPORT_FILE
    assert 'src="http' not in text and "<script" not in text and "<link" not in text
    assert len(re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+"', text)) == 5
    assert "BEHRT &lt;script&gt;" in text and "Next visit &amp; beyond" in text
    assert "Type 1 &lt;diabetes&gt;" in text and "a&lt;b" in text and "0.4321" in text
    assert "Synthetic data: not real patients" in text and "<details>" not in text  # 8 codes: no overflow
    for value in (m["overall"]["macro_ap"], b["overall"]["macro_ap"], m["overall"]["micro_auroc"]):
        assert fmt(value) in text
    low, high = m["overall"]["ci"]["macro_ap"]
    assert f"{fmt(m['overall']['macro_ap'])} ({fmt(low)}–{fmt(high)})" in text
    assert len(list((tmp_path / schema.PLOTS_DIR).glob("*.png"))) == 5


def test_report_without_baseline_and_collapsed_rows(evaluations: tuple, tmp_path: Path) -> None:
    m, _, _, _ = evaluations
    path = write_report(tmp_path, "model", ReportInputs(task="t", model=m, top_codes=3))
    text = path.read_text()
    assert "<details><summary>All other 5 codes</summary>" in text
    assert text.count("data:image/png;base64,") == 5
