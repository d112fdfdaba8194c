"""A multirun sweep of the main job: a failing job is reported and the others run; the sweep
is gathered into sweep.csv / sweep.md / sweep.html with the swept values, each job's status
and figures, on the basic launcher and on the parallel ones."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _sweep(tmp_path: Path, qps: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=30",
         "progress=false", f"workload.qps={qps}", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300, check=False)


CRASH = """\
import experiments.simulation as s
run = s.Simulation.run
def crash(self):
    if self.cfg['workload']['qps'] == 7:
        raise RuntimeError('broken on purpose')
    return run(self)
s.Simulation.run = crash
"""


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One sweep for the two tests of failing jobs (a command and its jobs take seconds): job
    1 is refused by the config check (qps=-1), job 2 raises in the run itself (for qps=7, by
    a ``sitecustomize`` module patched in before the command starts), jobs 0 and 3 run."""
    patch = tmp_path_factory.mktemp("patch")
    (patch / "sitecustomize.py").write_text(CRASH)
    out = tmp_path_factory.mktemp("sweep")
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=30",
         "progress=false", "workload.qps=5,-1,7,20", f"hydra.sweep.dir={out}"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{patch}{os.pathsep}{ROOT}"}, capture_output=True,
        text=True, timeout=300, check=False)
    return out, r


@pytest.mark.slow
def test_a_failing_job_is_reported_and_the_others_run(failing_sweep):
    out, r = failing_sweep
    assert r.returncode == 1
    table = pd.read_csv(out / "sweep.csv")
    assert list(table.columns[:3]) == ["job", "workload.qps", "status"]  # fixed values dropped
    assert table["status"].tolist() == ["complete", "failed", "failed", "complete"]
    assert table["completed"].tolist()[::3] == [30, 30]
    assert table["error"][1] == "config error: workload.qps: must be > 0, got -1.0"
    assert "job 1 (model=tiny workload.num_requests=30 progress=False workload.qps=-1) failed" \
        in r.stderr
    assert "job 3: model=tiny workload.num_requests=30 progress=False workload.qps=20" in r.stdout
    assert (out / "sweep.md").read_text().startswith("| job | workload.qps | status |")


@pytest.mark.slow
def test_a_sweep_that_succeeds_exits_0_with_its_table(tmp_path):
    r = _sweep(tmp_path, "5,20")
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert table["workload.qps"].tolist() == [5, 20]
    assert (table["status"] == "complete").all()
    assert table["request_throughput"][1] > table["request_throughput"][0]


@pytest.mark.slow
def test_a_job_that_crashes_is_recorded_and_the_sweep_is_still_gathered(failing_sweep):
    """Any exception, not only a config error (here the run itself raises for qps=7)."""
    out, r = failing_sweep
    assert r.returncode == 1, r.stderr
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["complete", "failed", "failed", "complete"]
    assert table["error"][2] == "RuntimeError: broken on purpose"
    assert ("job 2 (model=tiny workload.num_requests=30 progress=False workload.qps=7) failed: "
            "RuntimeError: broken on purpose; the sweep goes on") in r.stderr


@pytest.mark.slow
def test_sweep_csv_has_every_summary_key_and_sweep_html_draws_the_objective(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=20",
         "progress=false", "workload.qps=5,20", "policy=fcfs,sjf", "objective=mean_ttft_ms",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(tmp_path / "sweep.csv", keep_default_na=False)
    assert list(table.columns[:5]) == ["job", "workload.qps", "policy", "status", "error"]
    summary = json.loads((tmp_path / "3" / "summary.json").read_text())
    # Every summary.json key after them, in its order (status has its own column, and the
    # swept policy its override's).
    assert list(table.columns[5:]) == [k for k in summary if k not in ("status", "policy")]
    assert table["p90_ttft_ms_lo"][3] == pytest.approx(summary["p90_ttft_ms_lo"])
    assert (table["error"] == "").all()
    page = (tmp_path / "sweep.html").read_text()
    assert "mean_ttft_ms against workload.qps" in page and "mean_ttft_ms against policy" in page
    # The printed table keeps to the headline figures.
    md = (tmp_path / "sweep.md").read_text()
    assert md.startswith("| job | workload.qps | policy | status | completed |")
    assert "kv_block_size" not in md


@pytest.mark.slow
def test_the_objective_is_a_figure_runs_write(tmp_path):
    """Every name ``objective`` accepts is in the summary of a run with error bars and goodput
    SLOs; a name it does not accept is refused before any job runs, and in a sweep every job
    is refused the same way (the sweep ends gathered, exit 1)."""
    from experiments.intervals import with_intervals
    from experiments.run import OBJECTIVES, objective_name, objective_value
    from experiments.simulation import Simulation
    from tests.helpers import small_cfg

    cfg = small_cfg("goodput={ttft_ms:500}", "kv.enable_prefix_caching=true")
    summary = with_intervals(cfg, Simulation(cfg, None).run().summary)
    assert set(OBJECTIVES) <= set(summary)
    assert objective_value(summary, "p99_ttft_ms") == summary["p99_ttft_ms"]
    assert math.isnan(objective_value({}, "p99_ttft_ms"))  # a failed job
    assert math.isnan(objective_value({"request_goodput": None}, "request_goodput"))
    with pytest.raises(ConfigError, match="objective: 'p99' is not a figure a job can return"):
        objective_name({"objective": "p99"})
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "workload.num_requests=20",
         "progress=false", "workload.qps=5,20", "objective=nope", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert table["status"].tolist() == ["failed", "failed"]
    assert table["error"][0].startswith("config error: objective: 'nope' is not a figure")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "ray"])
def test_a_two_job_sweep_runs_on_a_parallel_launcher(tmp_path, launcher):
    """Hydra's joblib launcher (processes on this machine) and Ray launcher (a Ray cluster the
    launcher starts on this machine): the jobs run and the sweep is gathered as with the
    basic launcher."""
    pytest.importorskip(f"hydra_plugins.hydra_{launcher}_launcher")
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", f"hydra/launcher={launcher}",
         "model=tiny", "workload.num_requests=20", "progress=false", "workload.qps=5,20",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert table["workload.qps"].tolist() == [5, 20]
    assert (table["status"] == "complete").all()
    assert table["completed"].tolist() == [20, 20]
