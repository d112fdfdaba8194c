"""experiments/bench_sim.py: which outputs each case writes, and the whole command at a tiny
size (a smoke run, so the benchmark the speed targets are quoted from cannot rot; its figures
are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench_sim import ROOT, case_overrides


def _setting(overrides: list[str], key: str) -> str:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    assert len(values) == 1, overrides
    return values[0]


@pytest.mark.parametrize("n, steps_csv, record, itl", [
    (10_000, "auto", "true", "exact"),
    (100_000, "auto", "true", "streaming"),
    (200_000, "auto", "true", "streaming"),
    (200_001, "auto", "false", "streaming"),
    (100_000, "off", "false", "streaming"),
    (1_000_000, "on", "true", "streaming"),
])
def test_case_overrides_choose_the_outputs(n: int, steps_csv: str, record: str, itl: str) -> None:
    ov = case_overrides("fcfs", n, "fast", Path("unused"), steps_csv)
    assert _setting(ov, "record_steps") == record
    assert _setting(ov, "itl_quantiles") == itl
    assert _setting(ov, "workload.num_requests") == str(n)


def test_case_overrides_refuse_an_unknown_steps_setting() -> None:
    with pytest.raises(ValueError, match="steps_csv"):
        case_overrides("fcfs", 100, "fast", Path("unused"), "sometimes")


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    p = subprocess.run(
        [sys.executable, "-m", "experiments.bench_sim", "--sizes", "300", "--cases", "fcfs",
         "chunked_prefill", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # Table rows: case, req/s, requests, wall s, steps ... (not the closing lines).
    rows = {line.split()[0]: line for line in p.stdout.splitlines()
            if len(line.split()) > 3 and line.split()[2].replace(",", "").isdigit()}
    assert set(rows) == {"fcfs", "chunked_prefill"}
    for line in rows.values():
        fields = line.split()
        assert fields[1] == "6" and fields[2] == "300"  # arrival rate, requests
        assert int(fields[4].replace(",", "")) > 300  # steps: at least one per request
        assert "(no steps.csv)" in line
    assert "chunked_prefill / fcfs wall time at 300" in p.stdout
    case = out / "fcfs_300_fast"
    assert (case / "requests.csv").is_file() and (case / "summary.json").is_file()
    assert not (case / "steps.csv").exists()


@pytest.mark.parametrize("case, qps, expected", [
    ("fcfs_kv3000", "6", ["kv.num_gpu_blocks_override=3000"]),
    ("fcfs_kv3000_swap", "6", ["kv.num_gpu_blocks_override=3000", "policy.preemption_mode=swap"]),
    ("replicas4", "24", ["cluster.num_replicas=4", "cluster.router=least_outstanding"]),
    ("disagg2x2", "12", ["cluster=disaggregated", "cluster.num_prefill_replicas=2",
                         "cluster.num_decode_replicas=2"]),
])
def test_the_table_cases_set_their_layout_and_rate(case: str, qps: str,
                                                   expected: list[str]) -> None:
    ov = case_overrides(case, 1000, "fast", Path("unused"))
    assert _setting(ov, "workload.qps") == qps
    assert _setting(ov, "policy.max_num_seqs") == "128"
    assert set(expected) <= set(ov)


@pytest.mark.slow
def test_every_default_case_composes_and_runs(tmp_path: Path) -> None:
    """Each of the table's cases is a valid run (Hydra composes it, the simulation finishes
    every request): a typo in a case's overrides fails here, not in a benchmark run."""
    from experiments.bench_sim import DEFAULT_CASES, run_case

    for case in DEFAULT_CASES:
        r = run_case(case, 60, "fast", tmp_path / case, "off")
        assert r["completed"] == 60, case
