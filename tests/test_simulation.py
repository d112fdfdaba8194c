"""Whole runs through the composed Hydra config: determinism, conservation, validation."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation, run_simulation
from sim.errors import ConfigError
from tests.helpers import ROOT, compose_cfg, small_cfg


def test_same_config_and_seed_give_identical_requests_csv(tmp_path):
    run_simulation(small_cfg(), tmp_path / "a")
    run_simulation(small_cfg(), tmp_path / "b")
    a = (tmp_path / "a" / "requests.csv").read_text()
    assert a == (tmp_path / "b" / "requests.csv").read_text()
    assert len(a.splitlines()) == 61
    run_simulation(small_cfg("seed=1"), tmp_path / "c")
    assert a != (tmp_path / "c" / "requests.csv").read_text()


def test_outputs_and_summary_keys(tmp_path):
    res = run_simulation(small_cfg(), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("completed", "request_throughput", "output_throughput", "total_token_throughput",
                "rejected", "num_preemptions", "kv_block_size", "kv_num_gpu_blocks",
                "kv_bytes_per_token", "kv_peak_usage", "simulated_duration_s", "wall_time_s"):
        assert key in summary, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "p90", "p99"):
            assert f"{k}_{m}_ms" in summary
    assert summary["completed"] == 60 and summary["kv_bytes_per_token"] == 131072
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(steps) == summary["num_steps"]
    assert (steps["prefill_tokens"] + steps["decode_tokens"] > 0).all()
    reqs = pd.read_csv(tmp_path / "requests.csv")
    # TPOT as vLLM defines it; E2E >= TTFT.
    multi = reqs[reqs.output_len > 1]
    tpot = (multi.e2e_latency - multi.ttft) / (multi.output_len - 1)
    assert tpot.to_numpy() == pytest.approx(multi.tpot.to_numpy(), rel=1e-9)
    assert res.summary["output_throughput"] > 0


@pytest.mark.slow
def test_every_request_finishes_or_is_rejected_with_a_reason():
    # No CPU swap pool: the policy preempts by recompute, so the pool would stay idle, and
    # checking its 2,048 free blocks after each of the run's 15,000 steps was most of the
    # test's time. The GPU pool, where the preemptions happen, is checked after every step.
    cfg = small_cfg("kv.num_gpu_blocks_override=120", "workload.num_requests=100", "workload.qps=50",
                    "check_integrity=true", "kv.swap_space=0")
    assert cfg["policy"]["preemption_mode"] == "recompute"
    res = Simulation(cfg, keep_requests=True).run()
    s = res.summary
    assert s["completed"] + s["rejected"] == 100
    assert s["rejected"] > 0 and s["num_preemptions"] > 0  # pool of 1,920 tokens
    for r in res.requests:
        assert r.status.name in ("FINISHED", "REJECTED")
        if r.status.name == "REJECTED":
            assert r.reject_reason
        else:
            assert r.num_output_tokens == r.max_output_len
    assert res.replicas[0].kv.num_used_blocks == 0


@pytest.mark.parametrize("override,field", [
    ("workload.qps=0", "workload.qps"),
    ("workload.qps=-3", "workload.qps"),
    ("kv.block_size=0", "kv.block_size"),
    ("policy.max_num_batched_tokens=2048", "policy.max_num_batched_tokens"),
    ("model.num_kv_heads=5", "model.num_kv_heads"),
    ("policy.preemption_mode=drop", "policy.preemption_mode"),
    ("workload.prompt_len.dist=pareto", "workload.prompt_len.dist"),
])
def test_bad_input_is_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(override))
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_trace_row_that_does_not_parse_names_file_and_line(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,10,5\n1.0,abc,5\n")
    with pytest.raises(ConfigError, match=r"t\.csv:3: ContextTokens 'abc'"):
        Simulation(compose_cfg("workload=trace", f"workload.path={trace}"))


def _main(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_main_job_command_line_with_typical_overrides(tmp_path):
    p = _main("policy=fcfs", "hardware=h100_sxm", "model=llama3_70b",
              "cluster.tensor_parallel_size=4", "workload.qps=8", "workload.num_requests=500",
              f"hydra.run.dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert "llama3_70b on h100_sxm (TP4)" in p.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["completed"] == 500 and s["tensor_parallel_size"] == 4
    for f in ("requests.csv", "steps.csv", "report.html"):
        assert (tmp_path / f).exists()
    html = (tmp_path / "report.html").read_text()
    # offline: plotly.js from the file written beside the page
    assert "src='plotly.min.js'" in html and "src='http" not in html and 'src="http' not in html
    assert (tmp_path / "plotly.min.js").stat().st_size > 1_000_000


@pytest.mark.slow
def test_cfg_job_and_multirun(tmp_path):
    p = _main("--cfg", "job", "model=llama2_7b")
    assert p.returncode == 0 and "num_layers: 32" in p.stdout and "vocab_size: 32000" in p.stdout
    p = _main("-m", "workload.num_requests=20", "workload.qps=1,2",
              f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_dir()) == ["0", "1"]
    for d in ("0", "1"):
        assert json.loads((tmp_path / d / "summary.json").read_text())["completed"] == 20


@pytest.mark.slow
def test_unknown_model_lists_known_ones():
    p = _main("model=llama9")
    assert p.returncode != 0 and "llama3_8b" in p.stderr


@pytest.mark.slow
def test_config_error_exits_cleanly_with_field_name(tmp_path):
    p = _main("workload.qps=0", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2 and "workload.qps" in p.stderr and "Traceback" not in p.stderr


def test_prompts_beyond_the_context_are_rejected_not_refused(tmp_path):
    """A trace with prompts longer than max_model_len still runs: those requests are rejected
    at arrival with a reason (vLLM's behaviour); the batch budget is checked against the rest."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,10,5\n0.5,9000,5\n1.0,20,3\n")
    res = Simulation(compose_cfg("workload=trace", f"workload.path={trace}",
                                 "progress=false"), keep_requests=True).run()
    s = res.summary
    assert s["completed"] == 2 and s["rejected"] == 1 and s["reject_reasons"] == {"too_long": 1}
    assert [r.request_id for r in res.requests if r.reject_reason] == [1]


def test_step_rows_formatted_in_bulk_are_the_csv_writers_text(tmp_path):
    """Single steps write their steps.csv rows with one %-format (STEP_ROW_FORMAT); the file
    must read the same as csv.writer's, byte for byte."""
    from sim.outputs import STEP_COLUMNS, STEP_ROW_FORMAT, CsvSink

    rows = [(7, 0, repr(1.5), repr(0.025), 45, 0, 45, 45, 3, 45, 0, 5000,
             round(5000 / 28183, 6), 0, 0, 0, 0),
            (8, 2, repr(1e-05), repr(123456.78901234567), 1, 0, 1, 1, 0, 1, 0, 0, 0.0,
             0, 0, 0, 0),
            (9, 1, repr(2.0 ** 70), repr(3e-300), 128, 0, 128, 128, 17, 128, 2, 28183, 1.0,
             0, 0, 0, 0)]
    for name, fmt in (("bulk", STEP_ROW_FORMAT), ("writer", None)):
        sink = CsvSink(tmp_path / f"{name}.csv", STEP_COLUMNS)
        sink.write(rows[0])
        for row in rows[1:]:
            if fmt is None:
                sink.write(row)
            else:
                sink.write_formatted(row, fmt)
        sink.close()
    assert (tmp_path / "bulk.csv").read_bytes() == (tmp_path / "writer.csv").read_bytes()


@pytest.mark.parametrize("batch, running", [(45, 47), ([45, 45, 44, 41], [47, 47, 46, 43])])
def test_decode_step_rows_in_a_file_are_the_csv_writers_text_of_its_tuples(tmp_path, batch,
                                                                           running):
    """A jump's steps.csv rows: the file text (constant columns baked into the format,
    kv_usage memoized per block count) must be byte for byte what csv.writer writes for the
    tuples an in-memory sink receives."""
    from sim.outputs import STEP_COLUMNS, CsvSink, DecodeStepRows

    args = (12, [1.5, 1.525, 1.5500000000000003, 2.0 ** 70], [0.025, 0.025000000000000001,
            1e-05, 3e-300], batch, 3, running, 1, [5000, 5000, 5003, 28183])
    memory = CsvSink(None, STEP_COLUMNS)
    DecodeStepRows(memory, 2, 28183).write(*args)
    assert len(memory.rows) == 4 and memory.rows[2][:5] == (14, 2, "1.5500000000000003",
                                                            "1e-05", 45 if batch == 45 else 44)
    writer = CsvSink(tmp_path / "writer.csv", STEP_COLUMNS)
    writer.write_many(memory.rows)
    writer.close()
    text = CsvSink(tmp_path / "text.csv", STEP_COLUMNS)
    rows = DecodeStepRows(text, 2, 28183)
    rows.write(*args)
    rows.write(*args)  # the memoized kv_usage texts again
    text.close()
    header, body = (tmp_path / "writer.csv").read_bytes().split(b"\r\n", 1)
    assert (tmp_path / "text.csv").read_bytes() == header + b"\r\n" + body + body


@settings(max_examples=200, deadline=None)
@given(rid=st.integers(0, 10**12), replica=st.integers(0, 64), priority=st.integers(-3, 9),
       arrival=st.floats(0, 1e6, allow_subnormal=False), n=st.integers(1, 6),
       gaps=st.lists(st.floats(1e-9, 50.0), min_size=8, max_size=8),
       np_times=st.booleans(), token_ids=st.booleans(), preempted=st.integers(0, 3))
def test_finished_request_line_is_the_csv_writers_text_of_its_row(
        rid, replica, priority, arrival, n, gaps, np_times, token_ids, preempted):
    """A finished request's requests.csv line is formatted in one pass; it must be what
    csv.writer writes for request_row's tuple, byte for byte (numpy times included)."""
    import csv
    import io

    from sim.outputs import finished_request_line, request_row
    from sim.request import Request, RequestStatus

    req = Request(rid, arrival, 5, n, priority=priority)
    req.replica_id = replica
    t = np.cumsum([arrival] + gaps)
    as_time = np.float64 if np_times else float
    req.transition(RequestStatus.RUNNING)
    req.first_scheduled_time = as_time(t[1])
    for i in range(n):
        req.record_token(as_time(t[2 + i]), 1000 + 7 * i if token_ids else None)
    req.num_preemptions = req.num_recomputes = preempted
    req.finish_time = as_time(t[1 + n])
    req.transition(RequestStatus.FINISHED)
    out = io.StringIO(newline="")
    csv.writer(out).writerow(request_row(req))
    assert finished_request_line(req) == out.getvalue()


def test_finished_request_line_leaves_other_requests_to_the_writer():
    from sim.outputs import finished_request_line
    from sim.request import Request, RequestStatus

    waiting = Request(1, 0.0, 4, 2)
    waiting.replica_id = 0
    assert finished_request_line(waiting) is None
    waiting.reject("too_long: prompt 4 + output 2 > model.max_model_len 5")
    assert finished_request_line(waiting) is None
    odd = Request("a,b", 0.0, 4, 1)  # type: ignore[arg-type]  # would need quoting
    odd.replica_id = 0
    odd.transition(RequestStatus.RUNNING)
    odd.first_scheduled_time = 0.5
    odd.record_token(1.0)
    odd.finish_time = 1.0
    odd.transition(RequestStatus.FINISHED)
    assert finished_request_line(odd) is None


@pytest.mark.parametrize("overrides", [(), ("kv.num_gpu_blocks_override=300", "policy.preemption_mode=swap"),
                                       ("workload.num_requests=30", "model.max_model_len=1500")])
def test_csv_files_are_the_csv_writers_text_of_the_in_memory_rows(tmp_path, overrides):
    """The files' text (finished requests' lines and step rows formatted in one pass, jump
    rows in bulk) must be what csv.writer writes for the rows an in-memory run keeps."""
    import csv

    from sim.outputs import REQUEST_COLUMNS, STEP_COLUMNS

    cfg = small_cfg("record_steps=true", *overrides)
    run_simulation(cfg, tmp_path / "files")
    memory = run_simulation(cfg)
    assert memory.summary["completed"] > 0
    for name, columns, sink in (("requests", REQUEST_COLUMNS, memory.requests_sink),
                                ("steps", STEP_COLUMNS, memory.steps_sink)):
        with (tmp_path / f"{name}.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(columns)
            w.writerows(sink.rows)
        want = (tmp_path / f"{name}.csv").read_bytes()
        assert (tmp_path / "files" / f"{name}.csv").read_bytes() == want, name
