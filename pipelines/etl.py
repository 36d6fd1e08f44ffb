"""``behrt-rope etl``: raw histories in, the token dataset out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.engine.config import RayConfig
from behrt_rope.errors import UserError
from behrt_rope.etl import diagnostics
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.stage import is_done, stage, write_json

log = logging.getLogger("behrt_rope.etl")


@dataclass
class Config:
    input: str = ""
    """Directory holding the raw tables."""
    out: str = ""
    """Output directory of the token dataset."""
    overwrite: bool = False
    """Redo the work even if OUT already holds a finished run of the same configuration."""
    progress: bool = True
    """Show progress bars."""
    engine: Literal["local", "ray"] = "local"
    """local: shards one after another in this process; ray: shards in parallel on Ray (`behrt-rope[ray]`)."""
    etl: EtlConfig = field(default_factory=EtlConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def run(config: Config) -> Path:
    """Run the ETL; returns the output directory."""
    if not config.input or not config.out:
        raise UserError("etl needs --input DIR and --out DIR")
    input_dir, out_dir = Path(config.input), Path(config.out)
    if not input_dir.is_dir():
        raise UserError(f"input directory not found: {input_dir}")
    if not config.overwrite and is_done(out_dir, config):
        log.info("etl: %s already holds this run; skipping (overwrite=true to redo)", out_dir)
        return out_dir
    with stage(out_dir, config, "etl") as out:
        if config.engine == "ray":
            from behrt_rope.engine.ray_etl import run_etl_on_ray

            manifest = run_etl_on_ray(input_dir, out, config.etl, config.ray)
        else:
            manifest = run_etl(input_dir, out, config.etl, progress=config.progress)
        write_json(out / S.MANIFEST_FILE, manifest)  # written before the checks, to inspect a failed run
        write_json(
            out / S.ETL_SETTINGS_FILE,
            {
                "etl": config_lib.to_dict(config.etl),
                "patient_id_type": manifest["patient_id_type"],
            },
        )
        _log_summary(manifest, out)
        manifest["warnings"] = diagnostics.check(manifest)
        for warning in manifest["warnings"]:
            log.warning("%s", warning)
        write_json(out / S.MANIFEST_FILE, manifest)
    return out_dir


def _log_summary(manifest: dict, out: Path) -> None:
    for table, c in manifest["tables"].items():
        log.info(
            "etl: %s: %d rows = %d used + %d quarantined + %d duplicates + %d filtered%s",
            table,
            c["rows"],
            c["used"],
            c["quarantined"],
            c["duplicates_dropped"],
            c["filtered"],
            "" if c["reconciles"] else "  (DOES NOT RECONCILE)",
        )
    split = manifest["patients"]["by_split"]
    log.info(
        "etl: %d patients (%s), %d tokens, vocabulary %d; quarantine: %s",
        manifest["patients"]["with_tokens"],
        ", ".join(f"{k} {v}" for k, v in split.items()),
        manifest["sequence_length"]["tokens"],
        manifest["vocabulary"]["size"],
        out / S.QUARANTINE_FILE,
    )
