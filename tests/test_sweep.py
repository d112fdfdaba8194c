"""A multirun sweep of the main job: a failing job is reported and the others run; the sweep
is gathered into sweep.csv / sweep.md with the swept values, each job's status and figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def _sweep(tmp_path: Path, qps: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=30",
         "progress=false", f"workload.qps={qps}", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300, check=False)


def test_a_failing_job_is_reported_and_the_others_run(tmp_path):
    r = _sweep(tmp_path, "5,-1,20")
    assert r.returncode == 1
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table.columns[:3]) == ["job", "workload.qps", "status"]  # fixed values dropped
    assert table["status"].tolist() == ["complete", "failed", "complete"]
    assert table["completed"].tolist()[::2] == [30, 30]
    assert table["error"][1] == "config error: workload.qps: must be > 0, got -1.0"
    assert "job 1 (model=tiny workload.num_requests=30 progress=False workload.qps=-1) failed" \
        in r.stderr
    assert "job 2: model=tiny workload.num_requests=30 progress=False workload.qps=20" in r.stdout
    assert (tmp_path / "sweep.md").read_text().startswith("| job | workload.qps | status |")


def test_a_sweep_that_succeeds_exits_0_with_its_table(tmp_path):
    r = _sweep(tmp_path, "5,20")
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert table["workload.qps"].tolist() == [5, 20]
    assert (table["status"] == "complete").all()
    assert table["request_throughput"][1] > table["request_throughput"][0]


def test_a_job_that_crashes_is_recorded_and_the_sweep_is_still_gathered(tmp_path):
    """Any exception, not only a config error (here the run itself raises for qps=7)."""
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import experiments.simulation as s\n"
        "run = s.Simulation.run\n"
        "def crash(self):\n"
        "    if self.cfg['workload']['qps'] == 7:\n"
        "        raise RuntimeError('broken on purpose')\n"
        "    return run(self)\n"
        "s.Simulation.run = crash\n")
    out = tmp_path / "sweep"
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=20",
         "progress=false", "workload.qps=5,7,9", f"hydra.sweep.dir={out}"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{patch}{os.pathsep}{ROOT}"}, capture_output=True,
        text=True, timeout=300, check=False)
    assert r.returncode == 1, r.stderr
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["complete", "failed", "complete"]
    assert table["error"][1] == "RuntimeError: broken on purpose"
