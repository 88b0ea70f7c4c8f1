"""scripts/compare --merge (epscripts.fleet.compare.merge_runs): a later run's cells
replace an earlier run's, the rest are kept with the run they came from, and what
describes the quiet cells stays the run's that measured them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from epscripts.fleet.compare import merge_runs

pytestmark = pytest.mark.timeout(10)


def _run(started: str, commit: str, cells: list[tuple[str, str]], window: float,
         lbs: list[str]) -> dict[str, Any]:
    return {"started": started, "argv": ["scripts/compare", started], "commit": commit,
            "faults": sorted({f for _, f in cells}), "lbs": lbs, "skipped": {},
            "quiet_window_s": window, "quiet_warmup_s": 30.0,
            "versions": {b: commit for b in lbs}, "variants": {b: {} for b in lbs},
            "results": [{"lb": b, "fault": f, "lease_gap_max_s": 1.0} for b, f in cells]}


OLD = _run("03:34", "e514ded", [("extractedprism", "quiet"), ("haproxy", "quiet"),
                               ("extractedprism", "kill"), ("haproxy", "kill")],
           120.0, ["extractedprism", "haproxy"])


def test_a_later_cell_replaces_the_earlier_and_the_rest_keep_their_run() -> None:
    new = _run("16:51", "93e2c3c", [("extractedprism", "kill"), ("extractedprism", "stop")],
               300.0, ["extractedprism"])
    merged = merge_runs(OLD, new)
    cells = {(r["lb"], r["fault"]): r.get("run") for r in merged["results"]}
    assert cells == {("extractedprism", "quiet"): "03:34", ("haproxy", "quiet"): "03:34",
                     ("haproxy", "kill"): "03:34", ("extractedprism", "kill"): None,
                     ("extractedprism", "stop"): None}
    assert [r["commit"] for r in merged["runs"]] == ["e514ded", "93e2c3c"]
    assert merged["lbs"] == ["extractedprism", "haproxy"]
    assert merged["faults"] == ["quiet", "kill", "stop"]


def test_the_quiet_window_stays_the_run_that_measured_the_quiet_cells() -> None:
    # The later run measured no quiet cell: its --quiet-window default (300 s) must not
    # describe the earlier run's 120 s cells.
    new = _run("16:51", "93e2c3c", [("extractedprism", "kill")], 300.0, ["extractedprism"])
    assert merge_runs(OLD, new)["quiet_window_s"] == 120.0


def test_a_run_that_measured_quiet_cells_describes_them() -> None:
    new = _run("16:51", "93e2c3c", [("extractedprism", "quiet")], 60.0, ["extractedprism"])
    assert merge_runs(OLD, new)["quiet_window_s"] == 60.0
