"""Collection rules for the whole repository: ``--doctest-modules`` imports every module under the test paths.

A module that imports an optional extra at its top (Ray's engine, the MEDS schema package of the dev extra)
cannot be imported where that extra is missing, and collecting its doctests would fail the run with an import
error. ``make test`` installs every extra, so nothing is left out there; on a machine without one (a GPU image
with its own packages, a minimal install) those modules are skipped, as their tests already are
(``pytest.importorskip``).
"""

from __future__ import annotations

import importlib.util

NEEDS = {
    "ray": ["behrt_rope/engine/ray_etl.py", "behrt_rope/engine/ray_read.py"],
    "meds": ["tests/wild_data.py", "tests/test_wild_inputs.py"],
    "meds_evaluation": ["tests/test_wild_inputs.py"],
}
"""Optional top-level import -> the modules that import it at their top."""

MISSING = [module for module in NEEDS if importlib.util.find_spec(module) is None]
collect_ignore = sorted({path for module in MISSING for path in NEEDS[module]})


def pytest_report_header() -> list[str]:
    """Name what was left out, so that a run without an extra says so in its header."""
    return [f"not collected, {', '.join(MISSING)} missing: {', '.join(collect_ignore)}"] if MISSING else []
