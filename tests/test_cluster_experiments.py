"""Smoke runs of the cluster experiments at tiny sizes, and the goodput bisection itself."""

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.disaggregation as disagg
from experiments.common import slo_attainment
from experiments.disaggregation import Probe, goodput
from sim.request import Request, RequestStatus
from tests.helpers import CONF


def _compose(name, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("hydra", None)
    return out


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


def test_disaggregation_experiment_smoke(tmp_path):
    cfg = _compose("disaggregation", "experiment.duration_s=1", "experiment.min_requests=8",
                   "experiment.workers=1", "experiment.rel_tolerance=0.5",
                   "experiment.rate_max=4")
    exp = cfg["experiment"]
    exp["deployments"] = {k: exp["deployments"][k] for k in ("colocated_4", "disagg_1p3d")}
    rows = disagg.run_experiment(cfg, tmp_path)
    assert [(r["workload"], r["deployment"]) for r in rows] == [
        ("long_prompt", "colocated_4"), ("long_prompt", "disagg_1p3d"),
        ("long_output", "colocated_4"), ("long_output", "disagg_1p3d")]
    assert all(r["goodput_rps"] > 0 for r in rows)
    assert (tmp_path / "results.csv").exists()
    assert "goodput_rps" in (tmp_path / "results.md").read_text()


def test_routing_experiment_smoke(tmp_path):
    import experiments.routing as routing

    cfg = _compose("routing", "workload.num_requests=40", "experiment.workers=1",
                   "experiment.seeds=[0]", "experiment.routers=[round_robin,power_of_two]")
    rows = routing.run_experiment(cfg, tmp_path)
    assert [r["router"] for r in rows] == ["round_robin", "power_of_two"]
    assert all(r["p99_ttft_ms"] > 0 for r in rows)
    assert (tmp_path / "runs.csv").exists()
