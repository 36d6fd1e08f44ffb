"""MEDS diagnosis code styles: matching once per distinct code against running every regex on every row.

    python benchmarks/meds_code_styles.py [--rows 1000000] [--repeat 5] [--seed 0]

Builds a MEDS-like ``code`` column of ``--rows`` rows (labs, medications, encounters and diagnoses in the
default styles, a few thousand distinct codes, as in MIMIC-IV MEDS), then times

* ``ours``: :func:`behrt_rope.etl.code_styles.match`, which dictionary-encodes the column and runs the styles
  on the distinct codes only;
* ``baseline``: the same styles run on every row (first match wins), as a straightforward reader would.

Both results are checked to be identical. Prints one JSON object: best-of-``--repeat`` seconds of each, rows
per second, and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from behrt_rope.etl import code_styles
from behrt_rope.etl.config import MedsConfig


def codes(rows: int, seed: int) -> pa.Array:
    """A code column with the make-up of a MEDS export: mostly labs, some medications and diagnoses."""
    rng = np.random.default_rng(seed)
    pools = [
        [f"LAB//{i}//mg/dL" for i in range(800)],
        [f"MEDICATION//{i}" for i in range(1500)],
        [f"DIAGNOSIS//ICD//10//E{i:03d}" for i in range(600)] + [f"DIAGNOSIS//ICD//9//{i:04d}" for i in range(600)],
        [f"SNOMED//{10_000 + i}" for i in range(400)] + [f"ICD10CM/I{i:02d}" for i in range(90)],
        ["ENCOUNTER//AMB", "HOSPITAL_ADMISSION//EW", "HOSPITAL_DISCHARGE//HOME", "MEDS_BIRTH"],
    ]
    kind = rng.choice(len(pools), size=rows, p=[0.8, 0.1, 0.04, 0.02, 0.04])
    out = np.empty(rows, dtype=object)
    for k, pool in enumerate(pools):
        mine = kind == k
        out[mine] = np.asarray(pool, dtype=object)[rng.integers(0, len(pool), int(mine.sum()))]
    return pa.array(out, pa.string())


def per_row(column: pa.Array, styles: list[code_styles.Style], aliases: dict[str, str]) -> np.ndarray:
    """Baseline: every style's regex on every still-unmatched row; returns the style index per row."""
    style = np.full(len(column), -1, dtype=np.int64)
    for i, s in enumerate(styles):
        hit = np.asarray(pc.is_valid(pc.extract_regex(column, s.pattern)).to_numpy(zero_copy_only=False))
        style[(style < 0) & hit] = i
    return style


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    meds = MedsConfig()
    styles = code_styles.parse_styles(meds.code_patterns)
    aliases = code_styles.parse_aliases(meds.vocabulary_aliases)
    column = codes(args.rows, args.seed)
    ours = code_styles.match(column, styles, aliases)
    assert (ours.style == per_row(column, styles, aliases)).all(), "the two disagree"
    t_ours = best(lambda: code_styles.match(column, styles, aliases), args.repeat)
    t_base = best(lambda: per_row(column, styles, aliases), args.repeat)
    result = {
        "rows": args.rows,
        "distinct_codes": len(pc.unique(column)),
        "diagnoses": int((ours.style >= 0).sum()),
        "ours_seconds": round(t_ours, 4),
        "baseline_seconds": round(t_base, 4),
        "ours_rows_per_second": round(args.rows / t_ours),
        "baseline_rows_per_second": round(args.rows / t_base),
        "speedup": round(t_base / t_ours, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
