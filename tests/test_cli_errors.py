"""The analysis commands outside Hydra (fit_network, host_speed, refit_split, bench_sim): a
missing folder or file, or a bad argument, is one `config error` line (or argparse's usage
error) and exit 2, never a Python traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from experiments import bench_sim, fit_network, host_speed, refit_split


def test_fit_network_names_a_missing_folder_or_file(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["fit_network", "--profiles", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as exit_:
        fit_network.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: --profiles: file not found: {tmp_path / 'nowhere'}")
    monkeypatch.setattr(sys, "argv", ["fit_network", "--profiles", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        fit_network.main()
    assert exit_.value.code == 2
    assert f"{tmp_path / 'a100_dgx' / 'all_reduce.csv'} is missing" in capsys.readouterr().err


def test_fit_network_names_a_missing_column(tmp_path: Path) -> None:
    (tmp_path / "all_reduce.csv").write_text("size,num_workers\n1024,2\n")
    with pytest.raises(fit_network.ConfigError, match="missing column 'devices_per_node'"):
        fit_network.load(tmp_path, "all_reduce")


def test_host_speed_refuses_a_folder_that_is_not_a_validation(tmp_path: Path, capsys) -> None:
    assert host_speed.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: folder: {tmp_path} is not a finished validation: validation.json is "
        "missing (experiments/validate.py writes it)")


def test_host_speed_names_an_override_hydra_refuses(tmp_path: Path, capsys) -> None:
    for name in ["validation.json", "replay_steps.csv", "sim/summary.json", "real/summary.json"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")  # never read: the override fails first
    assert host_speed.main([str(tmp_path), "workload.qpss=3"]) == 2
    assert capsys.readouterr().err.startswith("config error: Could not override 'workload.qpss'")


def test_refit_split_refuses_before_printing_a_table(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        refit_split.main([str(tmp_path)])
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""  # no table header above the error
    assert out.err.startswith(f"config error: folder: {tmp_path} is not a saved validation: "
                              "profile.csv is missing")


@pytest.mark.parametrize("text, why", [("0", "must be >= 1, got 0"), ("-5", "must be >= 1"),
                                       ("1e5", "not a whole number: '1e5'")])
def test_bench_sim_sizes_are_whole_positive_counts(text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        bench_sim._request_count(text)
    assert bench_sim._request_count("300") == 300


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), [("kv.num_gpu_blocks", "kv.num_gpu_blocks_override"),
                                          ("kv.swap_space_gib", "kv.swap_space"),
                                          ("kv.cpu_offload_gib", "kv.kv_offloading_size")])
def test_a_key_renamed_to_vllms_name_is_refused_naming_the_new_one(tmp_path, old, new):
    """On the command line (Hydra refuses the key first) and in a config handed over whole."""
    import subprocess
    import sys

    from experiments.simulation import Simulation
    from sim.errors import ConfigError
    from tests.helpers import ROOT, small_cfg

    r = subprocess.run([sys.executable, "-m", "experiments.run", f"{old}=1",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == f"config error: {old}: renamed to {new} (vLLM's name)"
    cfg = small_cfg()
    cfg["kv"][old.split(".")[1]] = 1
    with pytest.raises(ConfigError, match=f"^{old}: renamed to {new}"):
        Simulation(cfg)


def test_the_models_kv_dtype_is_renamed_to_vllms_kv_cache_dtype():
    from experiments.simulation import Simulation
    from sim.errors import ConfigError
    from tests.helpers import small_cfg

    cfg = small_cfg()
    cfg["model"]["kv_dtype"] = "fp8"
    with pytest.raises(ConfigError, match=r"^model\.kv_dtype: renamed to model\.kv_cache_dtype"):
        Simulation(cfg)
    cfg = small_cfg("model.kv_cache_dtype=fp8")
    assert Simulation(cfg, None).run().summary["kv_bytes_per_token"] == 65_536


DISAGG = ("cluster=disaggregated",)


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new", "value", "groups"), [
    ("cluster.tensor_parallel", "cluster.tensor_parallel_size", "2", ()),
    ("cluster.pipeline_parallel", "cluster.pipeline_parallel_size", "2", ()),
    ("cluster.tensor_parallel", "cluster.tensor_parallel_size", "2", DISAGG),
    ("cluster.pipeline_parallel", "cluster.pipeline_parallel_size", "2", DISAGG),
    ("cluster.prefill.tensor_parallel", "cluster.prefill.tensor_parallel_size", "2", DISAGG),
    ("cluster.prefill.pipeline_parallel", "cluster.prefill.pipeline_parallel_size", "2", DISAGG),
    ("cluster.decode.tensor_parallel", "cluster.decode.tensor_parallel_size", "2", DISAGG),
    ("cluster.decode.pipeline_parallel", "cluster.decode.pipeline_parallel_size", "2", DISAGG),
    ("policy.chunked_prefill", "policy.enable_chunked_prefill", "true",
     ("policy=chunked_prefill",)),
    ("policy.chunked_prefill", "policy.enable_chunked_prefill", "true", ("policy=fcfs",)),
    ("policy.chunked_prefill", "policy.enable_chunked_prefill", "false", ("policy=fcfs",)),
    ("cluster.prefill.policy.chunked_prefill", "cluster.prefill.policy.enable_chunked_prefill",
     "true", DISAGG),
    ("cluster.decode.policy.chunked_prefill", "cluster.decode.policy.enable_chunked_prefill",
     "false", DISAGG),
])
def test_vllms_parallelism_and_chunked_prefill_names_refuse_the_others(tmp_path, old, new,
                                                                       value, groups):
    """On the command line (Hydra refuses the key first) and in a config handed over whole."""
    import subprocess

    from experiments.simulation import Simulation
    from sim.errors import ConfigError
    from tests.helpers import ROOT, small_cfg

    r = subprocess.run([sys.executable, "-m", "experiments.run", *groups, f"{old}={value}",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == f"config error: {old}: renamed to {new} (vLLM's name)"
    cfg = small_cfg(*groups)
    *path, key = old.split(".")
    section = cfg
    for name in path:
        section = section[name]
    section[key] = value == "true" if key == "chunked_prefill" else int(value)
    with pytest.raises(ConfigError, match=f"^{old}: renamed to {new}"):
        Simulation(cfg)


def test_a_cluster_or_policy_mapping_with_the_other_names_is_refused_naming_vllms():
    from policies import make_policy
    from sim.cluster.config import cluster_config_from
    from sim.errors import ConfigError

    for section, old, new in [
            ({"tensor_parallel": 2}, "tensor_parallel", "tensor_parallel_size"),
            ({"name": "single", "pipeline_parallel": 2}, "pipeline_parallel",
             "pipeline_parallel_size"),
            ({"name": "disaggregated", "tensor_parallel": 2}, "tensor_parallel",
             "tensor_parallel_size"),
            ({"name": "disaggregated", "prefill": {"tensor_parallel": 2}},
             "prefill.tensor_parallel", "prefill.tensor_parallel_size"),
            ({"name": "disaggregated", "decode": {"pipeline_parallel": 2}},
             "decode.pipeline_parallel", "decode.pipeline_parallel_size")]:
        with pytest.raises(ConfigError, match=rf"^cluster\.{old}: renamed to cluster\.{new} "):
            cluster_config_from(section)
    assert cluster_config_from({"tensor_parallel_size": 2,
                                "pipeline_parallel_size": 2}).num_gpus == 4
    for name in ("chunked_prefill", "fcfs", "vllm_v1"):
        with pytest.raises(ConfigError, match=r"^policy\.chunked_prefill: renamed to "
                                              r"policy\.enable_chunked_prefill "):
            make_policy({"name": name, "chunked_prefill": True})
    assert make_policy({"name": "chunked_prefill",
                        "enable_chunked_prefill": True}).config.enable_chunked_prefill


def test_renamed_keys_are_refused_in_a_whole_config_and_on_hydras_refusal(capsys):
    """The quick half of the command-line tests above: a config handed over whole (the kv
    section, a disaggregated pool's policy) and Hydra's refusal of an old key on the command
    line, each naming vLLM's key."""
    from hydra.errors import ConfigCompositionException

    from experiments.hydra_errors import hydra_errors_as_config_errors
    from experiments.simulation import Simulation
    from sim.errors import ConfigError
    from tests.helpers import compose_cfg, small_cfg

    for old, new in [("num_gpu_blocks", "num_gpu_blocks_override"),
                     ("swap_space_gib", "swap_space"), ("cpu_offload_gib", "kv_offloading_size")]:
        cfg = small_cfg()
        cfg["kv"][old] = 1
        with pytest.raises(ConfigError, match=rf"^kv\.{old}: renamed to kv\.{new} "):
            Simulation(cfg)
    cfg = compose_cfg("cluster=disaggregated")
    cfg["cluster"]["decode"]["policy"] = {"chunked_prefill": False}
    with pytest.raises(ConfigError, match=r"^cluster\.decode\.policy\.chunked_prefill: renamed "
                                          r"to cluster\.decode\.policy\.enable_chunked_prefill"):
        Simulation(cfg)
    with pytest.raises(SystemExit) as e, hydra_errors_as_config_errors():
        raise ConfigCompositionException("Could not override 'cluster.tensor_parallel'.")
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "config error: cluster.tensor_parallel: renamed to cluster.tensor_parallel_size "
        "(vLLM's name)")
