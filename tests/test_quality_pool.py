"""``benchmarks/quality_pool.py``: draws of one family pool into a mean whose interval narrows with the draws;
draws at different settings are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.quality_pool import family_summary, main, markdown, pool, record_share, standard_error


def _share(point: float, half_width: float) -> dict[str, Any]:
    return {"point": point, "ci": [point - half_width, point + half_width]}


def _run(
    tmp_path: Path,
    seed_offset: int,
    model: float,
    lead: float,
    overrides: list[str] | None = None,
    chains_share: float = 0.0,
    learned: float | None = None,
) -> Path:
    """A quality.py output with one `default` draw: the model's gap closed, gradient boosting's 0.5, the deep
    part's 0.1 below the model's, the learned parts' ``learned`` (no row when None) at ``chains_share``."""
    predictors = {
        "model": {"gap_closed": _share(model, 0.2), "gap_closed_one_cut": _share(model + 0.05, 0.2)},
        "model_deep_part": {"gap_closed": _share(model - 0.1, 0.2), "gap_closed_one_cut": None},
        "gradient_boosting": {"gap_closed": _share(0.5, 0.2), "model_minus_this": _share(lead, 0.006)},
        **({"model_learned_parts": {"gap_closed": _share(learned, 0.2)}} if learned is not None else {}),
    }
    run = {
        "benchmark": "quality",
        "seed_offset": seed_offset,
        "overrides": overrides or [],
        "split": [0.5, 0.05, 0.45],
        "patients": 8000,
        "task": "next_visit",
        "cohorts": {
            "default": {
                "train_wall_s": 600.0 + seed_offset,
                "finetune_choices": {"state_path_share": chains_share},
                "at_oracle_cuts": {"n_samples": 3400, **predictors},
            }
        },
    }
    file = tmp_path / f"d{seed_offset}.json"
    file.write_text(json.dumps(run))
    return file


def test_standard_error_is_read_off_a_95_percent_interval() -> None:
    assert standard_error(_share(0.7, 1.959964)) == pytest.approx(1.0)
    assert standard_error({"point": 0.7, "ci": None}) is None
    assert standard_error({"point": 0.7, "ci": [0.6, math.nan]}) is None


def test_pooled_interval_is_the_mean_of_independent_draws() -> None:
    one = pool([_share(0.6, 0.2)])
    four = pool([_share(p, 0.2) for p in (0.6, 0.7, 0.8, 0.9)])
    assert one is not None and four is not None
    assert one["ci"] == pytest.approx([0.4, 0.8])
    # four draws of the same precision: the mean's interval is half as wide, centred on the mean of the points
    assert four["point"] == pytest.approx(0.75)
    assert four["ci"] == pytest.approx([0.65, 0.85])
    assert four["between_draws_sd"] == pytest.approx(0.1291, abs=1e-4)
    # a draw without an interval still counts in the mean, and the mean then has no interval
    partial = pool([_share(0.6, 0.2), {"point": 0.8, "ci": None}, None])
    assert partial is not None and "ci" not in partial
    assert partial["point"] == pytest.approx(0.7) and partial["draws"] == 2
    assert pool([None, {"point": None}]) is None


def test_interval_over_cohorts_follows_the_spread_between_draws() -> None:
    """Draws that each measure precisely but disagree: the mean of these draws is known well, the family's mean
    over unseen cohorts is not. The second interval is Student's t on the points (t(3) = 3.182)."""
    scattered = pool([_share(p, 0.02) for p in (0.6, 0.7, 0.8, 0.9)])
    assert scattered is not None
    assert scattered["ci"] == pytest.approx([0.74, 0.76])
    half = 3.1824 * 0.1291 / 2
    assert scattered["across_cohorts_ci"] == pytest.approx([0.75 - half, 0.75 + half], abs=1e-3)
    # draws that agree: the interval over cohorts is narrow, however noisy each draw is
    agreeing = pool([_share(p, 0.3) for p in (0.74, 0.75, 0.76)])
    assert agreeing is not None
    assert agreeing["across_cohorts_ci"] == pytest.approx([0.7252, 0.7748], abs=1e-3)
    assert agreeing["ci"][1] - agreeing["ci"][0] > 0.3
    # one draw says nothing about the spread between cohorts
    assert "across_cohorts_ci" not in (pool([_share(0.6, 0.2)]) or {})


def test_main_pools_each_family_and_counts_the_lead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [_run(tmp_path, 2000, 0.9, 0.010), _run(tmp_path, 1000, 0.6, -0.001), _run(tmp_path, 3000, 0.75, 0.004)]
    table = tmp_path / "table.md"
    assert main([*map(str, files), "--markdown", str(table)]) == 0
    family = json.loads(capsys.readouterr().out)["families"]["default"]
    assert [d["seed_offset"] for d in family["draws"]] == [1000, 2000, 3000]
    assert family["pooled"]["model"]["gap_closed"]["point"] == pytest.approx(0.75)
    assert family["pooled"]["model"]["gap_closed_one_cut"]["point"] == pytest.approx(0.80)
    assert family["pooled"]["model"]["gap_closed_record"] is None  # no draw measured against the record
    lead = family["model_minus_gradient_boosting"]
    assert lead["point"] == pytest.approx(0.0043, abs=1e-4)
    assert (lead["draws_ahead"], lead["draws_clearly_ahead"]) == (2, 1)  # -0.001 behind; +0.004 +/- 0.006 unclear
    assert family["max_train_wall_s"] == 3600.0
    row = table.read_text().splitlines()[2]
    assert row.startswith("| `default` (3) | 75% (")
    assert "| 38% to 112% / 43% to 117% |" in row  # points 0.6, 0.75, 0.9: sd 0.15, t(2) = 4.303
    assert row.endswith("2 / 1 |")


def test_learned_parts_pool_over_the_draws_that_have_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The learned parts are the deep part where the chains had no share; a draw whose chains had a share and
    that was scored before the learned parts were has none, and is left out of that mean only."""
    files = [
        _run(tmp_path, 1000, 0.6, 0.0),  # chains at share 0: learned parts = deep part, 0.5
        _run(tmp_path, 2000, 0.7, 0.0, chains_share=0.9, learned=0.66),
        _run(tmp_path, 3000, 0.8, 0.0, chains_share=0.5),  # no row: not counted
    ]
    table = tmp_path / "table.md"
    assert main([*map(str, files), "--markdown", str(table)]) == 0
    pooled = json.loads(capsys.readouterr().out)["families"]["default"]["pooled"]
    assert pooled["model_learned_parts"]["gap_closed"]["point"] == pytest.approx(0.58)
    assert pooled["model_learned_parts"]["gap_closed"]["draws"] == 2
    assert pooled["model_deep_part"]["gap_closed"]["draws"] == 3
    assert "| 58% (" in table.read_text() and "[2] |" in table.read_text()


def test_draws_at_different_settings_are_refused(tmp_path: Path) -> None:
    files = [_run(tmp_path, 1000, 0.6, 0.0), _run(tmp_path, 2000, 0.7, 0.0, overrides=["trainer.max_epochs=5"])]
    with pytest.raises(SystemExit, match="default: draws at different settings"):
        main(list(map(str, files)))


def test_a_file_of_another_benchmark_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "etl_throughput"}))
    with pytest.raises(SystemExit, match=r"not an output of benchmarks/quality\.py"):
        main([str(other)])


def test_record_ceiling_is_the_record_oracles_share_of_the_state_gap() -> None:
    cuts = {
        "n_samples": 100,
        "logistic_regression": {"macro_ap": {"point": 0.22}},
        "oracle": {"macro_ap": {"point": 0.27}},
        "model": {"gap_closed": _share(0.7, 0.1)},
        "gradient_boosting": {"gap_closed": _share(0.5, 0.1), "model_minus_this": None},
    }
    with_record = {"train_wall_s": 1.0, "at_oracle_cuts": cuts, "record_oracle_macro_ap": {"point": 0.26}}
    without = {"train_wall_s": 1.0, "at_oracle_cuts": cuts}
    assert record_share(with_record) == pytest.approx(0.8)
    assert record_share(without) is None
    summary = family_summary([{"seed_offset": s, "cohort": c} for s, c in ((1, with_record), (2, without))])
    assert [d["record_oracle_share_of_gap"] for d in summary["draws"]] == [pytest.approx(0.8), None]
    assert summary["record_oracle_share_of_gap"]["point"] == pytest.approx(0.8)
    assert summary["model_minus_gradient_boosting"]["draws_ahead"] == 0  # no lead measured: not counted as ahead


@pytest.mark.parametrize(
    ("folder", "marker"),
    [("quality", "pooled"), ("quality_session66", "pooled-session66"), ("quality_session68", "pooled-session68")],
)
def test_the_docs_table_is_the_pool_of_the_committed_draws(
    capsys: pytest.CaptureFixture[str], folder: str, marker: str
) -> None:
    """docs/quality.md shows the pooled table of the draws kept in each folder of benchmarks/results/ (one per
    code version), as quality_pool.py writes it today: a draw added without the table rewritten (or the other way)
    fails here."""
    root = Path(__file__).resolve().parents[1]
    draws = sorted((root / "benchmarks" / "results" / folder).glob("*.json"))
    assert main(list(map(str, draws))) == 0
    table = markdown(json.loads(capsys.readouterr().out))
    page = (root / "docs" / "quality.md").read_text()
    start, end = page.index(f"<!-- {marker}:start -->\n"), page.index(f"<!-- {marker}:end -->")
    assert page[start + len(f"<!-- {marker}:start -->\n") : end] == table, (
        f"rewrite docs/quality.md's table between the {marker} markers: python benchmarks/quality_pool.py "
        f"benchmarks/results/{folder}/*.json --markdown T"
    )
