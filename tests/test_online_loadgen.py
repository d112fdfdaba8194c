"""A load generator of the field (NVIDIA's aiperf, from PyPI, in its own environment) drives
the online server at a fixed rate; what it measures per request agrees with the simulator's
own requests.csv (``python -m experiments.serve_loadgen``)."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
AIPERF = "aiperf==0.13.0"


def aiperf_env() -> Path:
    """aiperf's executable, in a virtual environment kept in the user's cache (it brings
    transformers, pyarrow and more, which the project does not need): made on first use."""
    home = Path.home() / ".cache" / "llmserve-sim" / AIPERF.replace("==", "-")
    exe = home / "bin" / "aiperf"
    if not exe.exists():
        venv.create(home, with_pip=True, clear=True)
        done = subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "-q",
                               AIPERF], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"pip install {AIPERF} failed:\n{done.stderr[-2000:]}"
    return exe


def test_aiperf_agrees_with_the_simulator(tmp_path):
    exe = aiperf_env()
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.serve_loadgen", f"loadgen.aiperf={exe}",
         "loadgen.request_count=200", "loadgen.request_rate=50", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    per = pd.read_csv(out / "loadgen.csv")
    assert len(per) == 200 and (per["output_len"] == 20).all()
    ttft = per["client_ttft_ms"] - per["sim_ttft_ms"]
    tpot = per["client_tpot_ms"] - per["sim_tpot_ms"]
    # The client sees each token a few ms of HTTP after its simulated time, never before it.
    assert 0 < ttft.median() < 15, ttft.describe()
    assert (ttft > -1).all(), ttft.describe()
    assert abs(tpot.median()) < 0.5, tpot.describe()
    assert "| median_ttft_ms |" in (out / "loadgen.md").read_text()
