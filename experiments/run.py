"""The main job: one simulation configured by Hydra.

    python -m experiments.run                       # the embedded default
    python -m experiments.run policy=fcfs hardware=h100_sxm model=llama3_70b \
        cluster.tensor_parallel=4 workload.qps=8 workload.num_requests=500
    python -m experiments.run -m workload.qps=2,4,8  # a multirun sweep

Writes requests.csv, steps.csv, summary.json and report.html into Hydra's output folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.simulation import Simulation
from sim.errors import exit_on_config_error
from sim.report import format_summary, write_report

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    container = OmegaConf.to_container(cfg, resolve=True)
    with exit_on_config_error():
        sim = Simulation(container, out_dir)
    result = sim.run()
    write_report(out_dir, result.summary)
    print(format_summary(result.summary))
    print(f"outputs: {out_dir}")
    return result.summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
