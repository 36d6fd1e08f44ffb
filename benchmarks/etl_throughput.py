"""ETL throughput: our vectorised ``run_etl`` against a straightforward pandas ``groupby().apply`` baseline.

    python benchmarks/etl_throughput.py [--patients N] [--events-target 1000000] [--format csv|parquet]
                                        [--shards K] [--repeat R] [--seed S]

Generates a synthetic cohort of about ``--events-target`` event rows (``synthetic_data.generator``, 1% of
deliberately bad rows), writes it once to a temporary directory, then measures, each in a fresh
subprocess so that peak memories stay apart:

* ``ours``: :func:`behrt_rope.etl.runner.run_etl` from the files to the finished token dataset;
* ``baseline``: the obvious implementation: pandas reads and parses, the same row filters, then a Python
  function per patient (``groupby("patient_id").apply``) that groups visits, orders, merges and truncates
  them and builds the token lists;
* ``ours_sharded`` (with ``--shards K`` > 1): ``run_etl`` with ``etl.shards=K``, for its peak memory.

The token tables and vocabularies of both are checked to be identical before anything is reported. Prints
one JSON object: wall seconds (best of ``--repeat`` for ours) and events per second, CPU seconds (user +
system, a steadier figure on a busy machine) and events per CPU second, peak resident memory (``VmHWM``
of the subprocess) beside the resident memory right after the imports, and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {"code_truncate": 3}  # the configs/etl/icd10_3char.yaml level; everything else at its default


# ---------------------------------------------------------------------------------------------------------
# The two implementations (each runs inside a measuring subprocess)
# ---------------------------------------------------------------------------------------------------------
def run_ours(input_dir: Path, out_dir: Path, shards: int) -> None:
    from behrt_rope.etl.config import EtlConfig
    from behrt_rope.etl.runner import run_etl

    run_etl(input_dir, out_dir, EtlConfig(**SETTINGS, shards=shards), progress=False)


def run_baseline(input_dir: Path, out_dir: Path) -> None:
    """The straightforward implementation of the same rules (visits format, single files)."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from behrt_rope import schema as S
    from behrt_rope.etl.config import EtlConfig
    from behrt_rope.etl.split import assign_splits

    config = EtlConfig(**SETTINGS)

    def read(name: str) -> pd.DataFrame:
        path = next(p for p in (input_dir / f"{name}.csv", input_dir / f"{name}.parquet") if p.exists())
        frame = pd.read_csv(path, dtype=str, keep_default_na=False) if path.suffix == ".csv" else pd.read_parquet(path)
        return frame.astype(object).fillna("").astype(str).apply(lambda c: c.str.strip())

    def parse(text: pd.Series) -> pd.Series:
        return pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True).dt.tz_localize(None)

    patients, events = read(S.PATIENTS_TABLE), read(S.EVENTS_TABLE)
    for column in (S.DEATH_DATE,):
        patients[column] = patients.get(column, "")
    for column in (S.VISIT_ID, S.CODE_SYSTEM):
        events[column] = events.get(column, "")

    # patients: one usable row per id
    birth, death = parse(patients[S.BIRTH_DATE]), parse(patients[S.DEATH_DATE])
    ok = (patients[S.PATIENT_ID] != "") & birth.notna() & ~((patients[S.DEATH_DATE] != "") & death.isna())
    ok &= ~(death.dt.normalize() < birth.dt.normalize())
    valid = pd.DataFrame({"id": patients[S.PATIENT_ID], "birth": birth, "death": death})[ok].drop_duplicates()
    usable = valid[~valid["id"].duplicated(keep=False)].set_index("id")

    # events: the same filters, then exact duplicates dropped
    events["time"] = parse(events[S.DATE])
    day = events["time"].dt.normalize()
    pid = events[S.PATIENT_ID]
    keep = pid.isin(usable.index) & events["time"].notna() & (events[S.CODE] != "")
    keep &= ~(day < pid.map(usable["birth"]).dt.normalize()) & ~(day > pid.map(usable["death"]).dt.normalize())
    events = events[keep].drop_duplicates([S.PATIENT_ID, "time", S.CODE, S.CODE_SYSTEM, S.VISIT_ID])

    def token(code: str, system: str) -> str:
        code = code.replace(".", "") if config.strip_code_dots or config.code_truncate else code
        code = code[: config.code_truncate] if config.code_truncate else code
        return f"{system}/{code}" if system else code

    def patient_visits(g: pd.DataFrame) -> list[tuple[pd.Timestamp, set[str]]]:
        """One patient's visits in order, merged and truncated to max_seq_len."""
        visits: dict[tuple[Any, ...], list[Any]] = {}
        for time_, code, system, vid in zip(g["time"], g[S.CODE], g[S.CODE_SYSTEM], g[S.VISIT_ID]):
            key = (0, vid, 0) if vid else (-1, "", time_.normalize())
            visit = visits.setdefault(key, [time_, set()])
            visit[0] = min(visit[0], time_)
            visit[1].add(token(code, system))
        ordered = [v for _, v in sorted(visits.items(), key=lambda kv: (kv[1][0], kv[0]))]
        while ordered and 1 + sum(len(tokens) + 1 for _, tokens in ordered) > config.max_seq_len:
            ordered.pop(0)
        return [(t, tokens) for t, tokens in ordered]

    per_patient = events.groupby(S.PATIENT_ID, sort=True).apply(patient_visits, include_groups=False)
    last_time = events.groupby(S.PATIENT_ID, sort=True)["time"].max()
    per_patient = per_patient[per_patient.map(len) > 0]
    ids = per_patient.index.to_numpy(dtype=object)
    splits = assign_splits(ids, config.split)

    counts: dict[str, int] = {}
    for visits, split in zip(per_patient, splits):
        if split == S.TRAIN:
            for _, tokens in visits:
                for t in tokens:
                    counts[t] = counts.get(t, 0) + 1
    codes = sorted(t for t, n in counts.items() if n >= config.min_code_count and t not in S.SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate([*S.SPECIAL_TOKENS, *codes])}
    unk_count = sum(n for t, n in counts.items() if t not in vocab or vocab[t] < S.N_SPECIAL)

    columns: dict[str, list[Any]] = {name: [] for name in S.TOKENS.names}
    for pid_, visits, split in zip(ids, per_patient, splits):
        birth_ = usable.loc[pid_, "birth"]
        token_ids, ages, segments, index, dates = [S.CLS_ID], [], [], [], []
        for i, (t, tokens) in enumerate(visits):
            ids_ = [*sorted(vocab[x] if vocab.get(x, 0) >= S.N_SPECIAL else S.UNK_ID for x in tokens), S.SEP_ID]
            age = (t.normalize() - birth_.normalize()).days / 365.25
            if i == 0:
                ages, segments, index, dates = [age], [0], [0], [t]
            token_ids += ids_
            ages += [age] * len(ids_)
            segments += [i % 2] * len(ids_)
            index += [i] * len(ids_)
            dates += [t] * len(ids_)
        row = {
            S.PATIENT_ID: pid_,
            S.SPLIT: split,
            S.BIRTH_DATE: birth_,
            S.DEATH_DATE: usable.loc[pid_, "death"],
            S.N_VISITS: len(visits),
            S.N_TOKENS: len(token_ids),
            S.LAST_EVENT_TIME: last_time[pid_],
            S.TOKEN_IDS: token_ids,
            S.AGES: ages,
            S.SEGMENTS: segments,
            S.VISIT_INDEX: index,
            S.VISIT_DATES: dates,
        }
        for name, value in row.items():
            columns[name].append(value)
    columns[S.DEATH_DATE] = [None if pd.isna(d) else d for d in columns[S.DEATH_DATE]]
    (out_dir / S.TOKENS_DIR).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=S.TOKENS), out_dir / S.TOKENS_DIR / "part-00000.parquet")
    train_count = [0] * S.N_SPECIAL + [counts[t] for t in codes]
    train_count[S.UNK_ID] = unk_count
    vocab_table = pa.table(
        {"token_id": np.arange(len(vocab), dtype=np.int32), "token": list(vocab), "train_count": train_count},
        schema=S.VOCAB,
    )
    pq.write_table(vocab_table, out_dir / S.VOCAB_FILE)


# ---------------------------------------------------------------------------------------------------------
# Measuring harness
# ---------------------------------------------------------------------------------------------------------
def _memory_mb(field: str) -> float:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of this process in MiB; ``ru_maxrss`` where /proc is missing.

    ``ru_maxrss`` alone would be misleading: Linux carries the parent's peak over into a child at exec.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_child(variant: str, input_dir: Path, out_dir: Path, shards: int) -> None:
    """Runs inside the subprocess: import, note memory, run, print seconds and peak memory as JSON."""
    import pandas  # noqa: F401  (imports are not part of the timing)

    import behrt_rope.etl.runner  # noqa: F401

    after_imports = _memory_mb("VmRSS")
    started, cpu = time.perf_counter(), _cpu_seconds()
    if variant == "baseline":
        run_baseline(input_dir, out_dir)
    else:
        run_ours(input_dir, out_dir, shards)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "peak_rss_mb": _memory_mb("VmHWM"),
                "rss_after_imports_mb": after_imports,
            }
        )
    )


def measure(variant: str, input_dir: Path, out_dir: Path, shards: int = 1) -> dict[str, float]:
    argv = [
        sys.executable,
        __file__,
        "--_child",
        variant,
        "--_input",
        str(input_dir),
        "--_out",
        str(out_dir),
        "--shards",
        str(shards),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(repeat: int, variant: str, input_dir: Path, out_dir: Path, shards: int = 1) -> dict[str, float]:
    runs = [measure(variant, input_dir, out_dir, shards) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["seconds"])
    return {
        **best,
        "runs_seconds": [round(r["seconds"], 3) for r in runs],
        "cpu_seconds": min(r["cpu_seconds"] for r in runs),
    }


def write_cohort(directory: Path, patients: int, seed: int, fmt: str) -> tuple[int, int]:
    """Generate and write the cohort; return (patient rows, event rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from synthetic_data.generator import SynthConfig, generate

    p, e = generate(SynthConfig(patients=patients, seed=seed, corrupt_fraction=0.01))
    directory.mkdir(parents=True, exist_ok=True)
    for name, frame in (("patients", p), ("events", e)):
        if fmt == "csv":
            frame.to_csv(directory / f"{name}.csv", index=False)
        else:
            pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), directory / f"{name}.parquet")
    return len(p), len(e)


def patients_for(events_target: int, seed: int) -> int:
    """Patients needed for about ``events_target`` event rows, from a small pilot cohort."""
    from synthetic_data.generator import SynthConfig, generate

    pilot = 1000
    _, events = generate(SynthConfig(patients=pilot, seed=seed + 1))
    return max(1, round(events_target * pilot / max(len(events), 1)))


def identical(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    from behrt_rope import schema as S

    tokens = [pq.read_table(d / S.TOKENS_DIR).sort_by(S.PATIENT_ID).combine_chunks() for d in (a, b)]
    vocabs = [pq.read_table(d / S.VOCAB_FILE) for d in (a, b)]
    return bool(tokens[0].equals(tokens[1]) and vocabs[0].equals(vocabs[1]) and tokens[0].num_rows > 0)


def figures(run: dict[str, float], events: int) -> dict[str, Any]:
    return {
        "seconds": round(run["seconds"], 3),
        "events_per_second": round(events / run["seconds"]),
        "cpu_seconds": round(run["cpu_seconds"], 3),
        "events_per_cpu_second": round(events / run["cpu_seconds"]),
        "peak_rss_mb": round(run["peak_rss_mb"], 1),
        "rss_after_imports_mb": round(run["rss_after_imports_mb"], 1),
        **({"runs_seconds": run["runs_seconds"]} if "runs_seconds" in run else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, help="patients to generate (default: enough for --events-target)")
    parser.add_argument("--events-target", type=int, default=1_000_000, help="approximate event rows")
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv", help="file format of the input")
    parser.add_argument("--shards", type=int, default=1, help="also measure run_etl with etl.shards=K (K > 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of our ETL; the fastest is reported")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--skip-baseline", action="store_true", help="measure our ETL only")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_generate", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_input", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        measure_child(args._child, Path(args._input), Path(args._out), args.shards)
        return
    if args._generate is not None:
        n_patients = args._generate or patients_for(args.events_target, args.seed)
        print(json.dumps(write_cohort(Path(args._input), n_patients, args.seed, args.format)))
        return

    with tempfile.TemporaryDirectory(prefix="etl_bench_") as tmp:
        root = Path(tmp)
        # generated in a subprocess, so that this process stays small (children inherit nothing)
        generate = [
            sys.executable,
            __file__,
            "--_generate",
            str(args.patients or 0),
            "--_input",
            str(root / "input"),
            "--events-target",
            str(args.events_target),
            "--seed",
            str(args.seed),
            "--format",
            args.format,
        ]
        done = subprocess.run(generate, capture_output=True, text=True, check=True, cwd=ROOT)
        patients, events = json.loads(done.stdout.strip().splitlines()[-1])
        load = os.getloadavg()
        ours = best_of(args.repeat, "ours", root / "input", root / "ours")
        report: dict[str, Any] = {
            "input": {
                "format": args.format,
                "patients": patients,
                "events": events,
                "seed": args.seed,
                "settings": SETTINGS,
            },
            "machine": {"cpus": os.cpu_count(), "load_average_1m_before": round(load[0], 2)},
            "ours": figures(ours, events),
        }
        if not args.skip_baseline:
            baseline = measure("baseline", root / "input", root / "baseline")
            if not identical(root / "ours", root / "baseline"):
                raise SystemExit("baseline and run_etl disagree: no figures reported")
            report["baseline"] = figures(baseline, events)
            report["identical_outputs"] = True
            report["speedup"] = round(baseline["seconds"] / ours["seconds"], 1)
        if args.shards > 1:
            sharded = best_of(1, "ours", root / "input", root / "sharded", args.shards)
            if not identical(root / "ours", root / "sharded"):
                raise SystemExit("sharded and unsharded run_etl disagree")
            report["ours_sharded"] = {"shards": args.shards, **figures(sharded, events)}
        print(json.dumps(report))


if __name__ == "__main__":
    main()
