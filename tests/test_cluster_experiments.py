"""Smoke runs of the cluster experiments at tiny sizes, and the goodput bisection itself."""

import pytest

import experiments.disaggregation as disagg
from experiments.common import merge, slo_attainment
from experiments.disaggregation import Probe, goodput
from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.request import Request, RequestStatus
from tests.helpers import compose_named

_compose = compose_named


def test_goodput_bisection_finds_the_threshold(monkeypatch):
    threshold = 13.7
    monkeypatch.setattr(disagg, "probe", lambda cfg, rate, slo: Probe(
        rate, 1.0 if rate <= threshold else 0.5, 0.0, 0.0))
    cfg = {"experiment": {"attainment": 0.9, "rel_tolerance": 0.01, "rate_start": 1.0,
                          "rate_max": 256.0}}
    good, probes = goodput(cfg, {})
    assert threshold * 0.99 <= good <= threshold
    assert [p.rate for p in probes[:5]] == [1.0, 2.0, 4.0, 8.0, 16.0]
    # Below the first probe: halves until one passes.
    monkeypatch.setattr(disagg, "probe", lambda cfg, rate, slo: Probe(
        rate, 1.0 if rate <= 0.3 else 0.0, 0.0, 0.0))
    good, _ = goodput(cfg, {})
    assert 0.297 <= good <= 0.3


def test_slo_attainment_counts_rejected_and_slow_requests_as_misses():
    def done(ttft, tokens):
        r = Request(0, 0.0, 4, len(tokens))
        r.status = RequestStatus.FINISHED
        for t in tokens:
            r.record_token(t)
        assert r.ttft == ttft
        return r

    ok = done(0.5, [0.5, 0.6, 0.7])  # TPOT 0.1
    slow_ttft = done(2.0, [2.0])
    slow_tpot = done(0.5, [0.5, 1.5])
    one = done(0.2, [0.2])
    assert slo_attainment([ok, slow_ttft, slow_tpot, one], 5, 1.0, 0.2) == 2 / 5


@pytest.mark.slow
def test_disaggregation_experiment_smoke(tmp_path):
    cfg = _compose("disaggregation", "experiment.duration_s=1", "experiment.min_requests=8",
                   "experiment.workers=1", "experiment.rel_tolerance=0.5",
                   "experiment.rate_max=4", "experiment.seeds=[0,1]")
    exp = cfg["experiment"]
    names = ("colocated_fcfs", "colocated_chunked", "disagg_1p3d_chunked")
    exp["deployments"] = {k: exp["deployments"][k] for k in names}
    rows = disagg.run_experiment(cfg, tmp_path)
    assert [(r["workload"], r["deployment"], r["policy"]) for r in rows] == [
        (w, d, p) for w in ("long_prompt", "long_output") for d, p in zip(
            names, ("fcfs", "chunked_prefill", "chunked_prefill/fcfs"))]
    assert all(r["goodput_rps"] > 0 and len(r["goodput_per_seed"].split(" / ")) == 2
               for r in rows)
    runs = (tmp_path / "runs.csv").read_text().splitlines()
    assert len(runs) == 1 + 2 * 3 * 2  # header, workloads x deployments x seeds
    assert (tmp_path / "results.csv").exists()
    assert "goodput_rps" in (tmp_path / "results.md").read_text()


def test_deployment_policies_reach_each_pool():
    cfg = _compose("disaggregation")
    run = disagg.deployment_config(cfg, "colocated_chunked")
    assert run["policy"]["name"] == "chunked_prefill"
    assert run["policy"]["max_num_batched_tokens"] == 512
    assert run["cluster"] == {"name": "single", "num_replicas": 4, "router": "least_outstanding"}
    run = disagg.deployment_config(cfg, "disagg_3p1d_chunked")
    assert run["policy"]["name"] == "fcfs"
    assert run["cluster"]["prefill"]["policy"]["name"] == "chunked_prefill"
    assert run["cluster"]["decode"]["policy"] == {}
    run.pop("experiment")
    sim = Simulation(merge(run, {"progress": False}), None)
    assert [p.first_policy.config.name for p in sim.pools] == ["chunked_prefill", "fcfs"]
    assert sim.pools[0].first_policy.config.max_num_batched_tokens == 512
    assert sim.pools[1].first_policy.config.max_num_batched_tokens == 8192


def test_deployment_config_errors_name_the_field():
    cfg = _compose("disaggregation")
    deps = cfg["experiment"]["deployments"]
    deps["bad_name"] = {"policy": "nope", "cluster": {"name": "single"}}
    deps["bad_key"] = {"policy": "fcfs", "cluster": {"name": "single"}, "router": "x"}
    deps["no_policy"] = {"cluster": {"name": "single"}}
    deps["pool_policy_colocated"] = {"policy": "fcfs", "prefill_policy": "chunked",
                                     "cluster": {"name": "single"}}
    deps["old_style"] = {"name": "single", "num_replicas": 4}
    expected = {"bad_name": "experiment.deployments.bad_name.policy",
                "bad_key": "experiment.deployments.bad_key.router",
                "no_policy": "experiment.deployments.no_policy.policy",
                "pool_policy_colocated":
                    "experiment.deployments.pool_policy_colocated.prefill_policy",
                "old_style": "experiment.deployments.old_style"}
    for name, field in expected.items():
        with pytest.raises(ConfigError) as e:
            disagg.deployment_config(cfg, name)
        assert e.value.field == field, name


def test_limited_by_reads_the_lowest_failing_probe():
    probes = [Probe(8.0, 0.95, 0, 0, 0.99, 0.96), Probe(16.0, 0.2, 0, 0, 0.3, 0.2),
              Probe(12.0, 0.85, 0, 0, 0.95, 0.86), Probe(10.0, 0.89, 0, 0, 0.92, 0.93)]
    assert disagg.limited_by(probes, 8.0, 0.9) == "either"
    assert disagg.limited_by(probes[:3], 8.0, 0.9) == "tpot"
    assert disagg.limited_by(probes[:1], 8.0, 0.9) == ""


def test_routing_experiment_smoke(tmp_path):
    from experiments import routing

    cfg = _compose("routing", "workload.num_requests=40", "experiment.workers=1",
                   "experiment.seeds=[0]", "experiment.routers=[round_robin,power_of_two]")
    rows = routing.run_experiment(cfg, tmp_path)
    assert [r["router"] for r in rows] == ["round_robin", "power_of_two"]
    assert all(r["p99_ttft_ms"] > 0 for r in rows)
    assert (tmp_path / "runs.csv").exists()
