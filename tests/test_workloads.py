"""Workload generators and trace replay."""

import itertools

import numpy as np
import pytest

from sim.errors import ConfigError
from workloads.base import make_workload
from workloads.distributions import ArrivalProcess, LengthDistribution
from tests.helpers import SHARED, compose_cfg

LOGNORMAL = {"dist": "lognormal", "median": 1000, "sigma": 0.5, "min": 4, "max": 4096}


def synthetic(**kw):
    cfg = {"name": "synthetic", "num_requests": 2000, "qps": 5.0, "prompt_len": LOGNORMAL,
           "output_len": {"dist": "lognormal", "median": 130, "sigma": 1.0, "max": 1000}}
    cfg.update(kw)
    return make_workload(cfg, seed=0)


def test_default_workload_is_the_documented_one():
    cfg = compose_cfg()["workload"]
    reqs = list(make_workload(cfg, seed=0))
    assert len(reqs) == 2000
    prompts = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.max_output_len for r in reqs])
    times = np.array([r.arrival_time for r in reqs])
    assert 900 < np.median(prompts) < 1100 and 115 < np.median(outs) < 145
    assert outs.max() <= 1000
    assert np.all(np.diff(times) >= 0)
    assert 4.6 < len(reqs) / times[-1] < 5.4  # Poisson at 5 req/s


def test_generation_is_lazy_and_seeded():
    w = synthetic(num_requests=10**9)  # a billion requests: only what is consumed is built
    first = [(r.arrival_time, r.prompt_len) for r in itertools.islice(iter(w), 5)]
    again = [(r.arrival_time, r.prompt_len) for r in itertools.islice(iter(w), 5)]
    assert first == again
    other = make_workload({**_cfg(), "num_requests": 5}, seed=1)
    assert first != [(r.arrival_time, r.prompt_len) for r in other]


def _cfg():
    return {"name": "synthetic", "num_requests": 5, "qps": 5.0, "prompt_len": LOGNORMAL,
            "output_len": {"dist": "fixed", "value": 7}}


@pytest.mark.parametrize("kind,cv", [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5),
                                     ("constant", 0.0)])
def test_arrival_processes_have_the_asked_rate_and_burstiness(kind, cv):
    gaps = ArrivalProcess(kind, 4.0, cv if cv else 1.0).gaps(np.random.default_rng(0), 200_000)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.05)


def test_length_distributions():
    rng = np.random.default_rng(0)
    u = LengthDistribution.from_dict("x", {"dist": "uniform", "min": 3, "max": 9}).sample(rng, 10_000)
    assert u.min() == 3 and u.max() == 9
    z = LengthDistribution.from_dict("x", {"dist": "zipf", "a": 1.2, "min": 10, "max": 500})
    zs = z.sample(rng, 50_000)
    assert zs.min() == 10 and zs.max() <= 500
    assert (zs == 10).mean() > (zs == 11).mean() > (zs == 20).mean()
    f = LengthDistribution.from_dict("x", {"dist": "fixed", "value": 42}).sample(rng, 3)
    assert f.tolist() == [42, 42, 42]


def test_bad_length_options_name_the_field():
    with pytest.raises(ConfigError, match="workload.prompt_len.median"):
        LengthDistribution.from_dict("workload.prompt_len", {"dist": "lognormal", "sigma": 1, "max": 9})
    with pytest.raises(ConfigError, match="workload.prompt_len.max"):
        LengthDistribution.from_dict("workload.prompt_len", {"dist": "uniform", "min": 9, "max": 3})
    with pytest.raises(ConfigError, match="workload.prompt_len.mean"):
        LengthDistribution.from_dict("workload.prompt_len", {"dist": "fixed", "value": 3, "mean": 2})


def test_switching_distribution_on_the_command_line_keeps_other_keys_harmless():
    cfg = compose_cfg("workload.prompt_len.dist=uniform", "workload.prompt_len.min=10",
                      "workload.prompt_len.max=20")["workload"]
    prompts = {r.prompt_len for r in make_workload(cfg, seed=0)}
    assert min(prompts) == 10 and max(prompts) == 20


def test_trace_time_scale_and_caps(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0000000,10,5\n"
                 "2023-11-16 18:15:48.5000000,20,0\n"
                 "2023-11-16 18:15:47.0000000,30,900\n")
    w = make_workload({"name": "trace", "path": str(p), "time_scale": 0.5,
                       "max_output_len": 100}, seed=0)
    rows = [(r.arrival_time, r.prompt_len, r.max_output_len) for r in w]
    # Sorted by time, shifted to start at 0, halved; zero outputs become one token; capped.
    assert rows == [(0.0, 10, 5), (0.5, 30, 100), (1.25, 20, 1)]
    assert w.max_prompt_len == 30


@pytest.mark.parametrize("text,match", [
    ("time,a,b\n1,2,3\n", r":1: expected header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,1\n1,7\n", r":3: expected 3 columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,1\nnot-a-time,7,1\n", r":3: TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,0,1\n", r":2: ContextTokens must be"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,4.5,1\n", r":2: ContextTokens must be"),
])
def test_malformed_trace_rows_name_file_and_line(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert "bad.csv" in str(e.value) and e.value.field == "workload.path"


def test_missing_trace_file_is_a_config_error():
    with pytest.raises(ConfigError, match="workload.path: file not found"):
        make_workload({"name": "trace", "path": "no/such/file.csv"}, seed=0)


@pytest.mark.skipif(not (SHARED / "traces").exists(), reason="../shared/traces absent")
@pytest.mark.parametrize("name,rows,median_in", [("azure_llm_2023_conv.csv", 19366, 1020),
                                                 ("azure_llm_2023_code.csv", 8819, 1469),
                                                 ("mooncake_conversation.jsonl", 12031, None)])
def test_real_traces_parse(name, rows, median_in):
    w = make_workload({"name": "trace", "path": str(SHARED / "traces" / name)}, seed=0)
    assert w.num_requests == rows
    ins = [r.prompt_len for r in w]
    if median_in:
        assert abs(np.median(ins) - median_in) <= 2


def test_total_length_split_like_vidur():
    cfg = compose_cfg("workload=vidur_bench", "workload.num_requests=3000")["workload"]
    w = make_workload(cfg, seed=42)
    reqs = list(w)
    for r in reqs:
        total = r.prompt_len + r.max_output_len
        assert 256 <= total <= 2048
        assert r.max_output_len == -(-total // 4)
    assert w.max_prompt_len == 2048 - 512
