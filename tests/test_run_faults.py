"""The main job under faults: outputs are whole or marked. summary.json is strict JSON; a file
that cannot be written ends the run with one line and leaves no file that looks complete; a
signal stops the run with a summary marked interrupted; a folder holding another run's
outputs is refused; default folders of runs started together differ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SMALL = ["model=tiny", "workload.num_requests=40", "progress=false"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def _strict(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}: not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.slow
def test_a_summary_without_latencies_is_strict_json(tmp_path):
    # Every prompt is longer than the model's context: all rejected, no latency exists.
    r = _run(*SMALL, "model.max_model_len=64", "workload.prompt_len.min=100",
             f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    s = _strict(tmp_path / "summary.json")
    assert s["status"] == "complete" and s["rejected"] == 40


def test_figures_json_cannot_carry_are_written_as_null(tmp_path):
    from experiments.simulation import Simulation
    from tests.helpers import compose_cfg

    sim = Simulation(compose_cfg("model=tiny", "workload.num_requests=5"), tmp_path)
    sim.write_summary({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}})
    assert _strict(tmp_path / "summary.json") == {"a": None, "b": [1.0, None], "c": {"d": None}}
    assert not (tmp_path / "summary.json.partial").exists()


@pytest.mark.slow
def test_a_write_failure_is_one_line_and_leaves_nothing_that_looks_complete(tmp_path):
    """The disk fills up while requests.csv is written (its writer raises ENOSPC, patched in
    by a ``sitecustomize`` module before the command starts)."""
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import errno, pathlib\n"
        "class Full:\n"
        "    def __init__(self, f, path):\n"
        "        self.f, self.path, self.n = f, path, 0\n"
        "    def write(self, text):\n"
        "        self.n += len(text)\n"
        "        if self.n > 2000:\n"
        "            raise OSError(errno.ENOSPC, 'No space left on device', str(self.path))\n"
        "        return self.f.write(text)\n"
        "    def close(self):\n"
        "        self.f.close()\n"
        "opened = pathlib.Path.open\n"
        "def open_(self, *a, **k):\n"
        "    f = opened(self, *a, **k)\n"
        "    return Full(f, self) if self.name == 'requests.csv.partial' else f\n"
        "pathlib.Path.open = open_\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "experiments.run", *SMALL, f"hydra.run.dir={out}"],
                       cwd=ROOT, env={**ENV, "PYTHONPATH": f"{patch}{os.pathsep}{ROOT}"},
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"write error: {out / 'requests.csv.partial'}: No space left on device"]
    names = {p.name for p in out.iterdir()}
    assert not names & {"requests.csv", "steps.csv", "summary.json", "report.html", ".run.lock"}


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,engine,replicas", [(signal.SIGINT, 130, "replica", 1),
                                                      (signal.SIGTERM, 143, "array_core", 1),
                                                      (signal.SIGTERM, 143, "array_core", 3)])
def test_a_signal_stops_the_run_with_a_summary_marked_interrupted(tmp_path, sig, code, engine,
                                                                  replicas):
    """Each loop stops between steps: every request it counted has its row. 200,000
    requests keep each loop running for many seconds after its first rows (the array core
    builds every request's arrays before its first step: a larger workload only delays the
    signal)."""
    model = ["model=tiny", "workload.qps=1000", "workload.prompt_len.max=1000",
             "workload.output_len.max=500"] if engine == "array_core" else [
        "workload.qps=100", "array_core=false"]
    model.append(f"cluster.num_replicas={replicas}")
    p = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "workload.num_requests=200000", *model,
         "progress=false", "record_steps=false",
         f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "requests.csv.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size > 10_000):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
        time.sleep(0.1)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == code
    line = (f"interrupted by {sig.name}: the rows so far and summary.json (status "
            f"\"interrupted\") are in {tmp_path}")
    assert err.strip().splitlines() == [line]
    s = _strict(tmp_path / "summary.json")
    assert s["status"] == "interrupted" and s["interrupted_by"] == sig.name
    assert s["step_engine"] == engine
    rows = pd.read_csv(tmp_path / "requests.csv")  # whole rows only
    assert len(rows) == s["completed"] + s["rejected"] > 0
    if replicas > 1:
        assert len(s["replicas"]) == replicas
        assert sum(r["routed"] for r in s["replicas"]) >= len(rows)
        assert set(rows["replica_id"]) == set(range(replicas))
    assert not partial.exists() and not (tmp_path / ".run.lock").exists()


@pytest.mark.slow
def test_a_folder_with_another_runs_outputs_is_refused_unless_overwrite(tmp_path):
    assert _run(*SMALL, f"hydra.run.dir={tmp_path}").returncode == 0
    before = (tmp_path / "requests.csv").read_text()
    again = _run(*SMALL, "workload.num_requests=30", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 2
    assert again.stderr.startswith(f"config error: hydra.run.dir: {tmp_path} holds another "
                                   "run's outputs")
    assert (tmp_path / "requests.csv").read_text() == before
    over = _run(*SMALL, "workload.num_requests=30", "overwrite=true",
                f"hydra.run.dir={tmp_path}")
    assert over.returncode == 0, over.stderr
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 30


@pytest.mark.slow
def test_two_runs_into_one_folder_at_once_one_is_refused(tmp_path):
    # 1,000 requests hold the folder for seconds (the run, its error bars' two runs and the
    # report), far longer than the two commands' start-ups differ.
    args = [sys.executable, "-m", "experiments.run", "model=tiny", "workload.num_requests=1000",
            "progress=false", f"hydra.run.dir={tmp_path}"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 1000


@pytest.mark.slow
def test_default_folders_of_runs_started_together_differ(tmp_path):
    args = [sys.executable, "-m", "experiments.run", *SMALL]
    procs = [subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    summaries = sorted((tmp_path / "outputs" / "runs").glob("*/*/summary.json"))
    assert len(summaries) == 2
    for s in summaries:
        assert _strict(s)["completed"] == 40


def test_a_stalled_run_leaves_its_rows_as_partial(tmp_path):
    from experiments.simulation import Simulation
    from sim.replica import SimulationStalled
    from tests.helpers import compose_cfg

    sim = Simulation(compose_cfg("model=tiny", "workload.num_requests=5", "array_core=false"),
                     tmp_path)
    sim.policy.schedule = lambda step: step.build()  # never admits anyone: the run stalls
    for pool in sim.pools:
        pool.first_policy.schedule = sim.policy.schedule
    with pytest.raises(SimulationStalled):
        sim.run()
    names = {p.name for p in tmp_path.iterdir()}
    assert "requests.csv.partial" in names and "requests.csv" not in names
    assert "summary.json" not in names
