"""A load generator of the field against the online server, next to the simulator's own
figures for the same run.

    python -m experiments.serve_loadgen loadgen.aiperf=.venv-aiperf/bin/aiperf

Starts ``python -m experiments.serve`` (every override but ``loadgen.*`` goes to it), drives it
with NVIDIA's aiperf at a constant request rate (streamed completions or chat, a fixed output
length), stops it with SIGINT, and compares what aiperf measured per request with what the
server wrote (requests.csv, summary.json). aiperf writes its prompts with a Hugging Face
tokenizer; a small one is built locally (``online/local_tokenizer.py``), nothing is
downloaded. Writes ``loadgen.csv`` (per request: the client's and the simulator's TTFT, TPOT
and E2E latency, in ms) and ``loadgen.md`` (the table printed) into the run's folder, with
aiperf's own exports under ``aiperf/`` and the server's outputs under ``server/``.

The client's figures are wall-clock times; the simulator's are simulated seconds, divided by
``serve.speed`` for the comparison.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.common import markdown_table
from experiments.hydra_errors import hydra_errors_as_config_errors
from experiments.run import resolved
from sim.errors import ConfigError, exit_on_config_error, exit_with, require, require_known_fields

log = logging.getLogger(__name__)
TOKENIZER_REPO = "local/sim-bpe"


@dataclass(frozen=True)
class LoadgenConfig:
    aiperf: str = "aiperf"
    request_rate: float = 20.0
    request_count: int = 200
    input_tokens: int = 100
    output_tokens: int = 20
    endpoint: str = "completions"
    timeout_s: float = 600

    @classmethod
    def from_dict(cls, data: Any) -> LoadgenConfig:
        if not isinstance(data, dict):
            raise ConfigError("loadgen", f"must be a mapping, got {data!r}")
        require_known_fields(data, cls, "loadgen", "option")
        c = cls(**data)
        require(isinstance(c.request_rate, (int, float)) and math.isfinite(c.request_rate)
                and c.request_rate > 0, "loadgen.request_rate",
                f"must be a positive number of requests per second, got {c.request_rate!r}")
        for name in ("request_count", "input_tokens", "output_tokens"):
            value = getattr(c, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"loadgen.{name}", f"must be an integer >= 1, got {value!r}")
        require(c.output_tokens >= 2, "loadgen.output_tokens",
                f"must be >= 2 (a TPOT needs two tokens), got {c.output_tokens}")
        require(c.endpoint in ("completions", "chat"), "loadgen.endpoint",
                f"must be completions or chat, got {c.endpoint!r}")
        require(isinstance(c.timeout_s, (int, float)) and c.timeout_s > 0, "loadgen.timeout_s",
                f"must be > 0 seconds, got {c.timeout_s!r}")
        return c


def aiperf_python(aiperf: str) -> Path:
    """The interpreter of aiperf's environment (it builds the tokenizer there)."""
    import shutil

    exe = shutil.which(aiperf)
    if exe is None:
        raise ConfigError("loadgen.aiperf", f"no aiperf executable {aiperf!r}: install it in "
                          f"its own environment (python -m venv .venv-aiperf && "
                          f".venv-aiperf/bin/pip install aiperf==0.13.0) and point here")
    python = Path(exe).resolve().parent / "python"
    if not python.exists():
        raise ConfigError("loadgen.aiperf", f"no python beside {exe}: aiperf must be "
                          f"installed in a virtual environment")
    return python


def run_aiperf(c: LoadgenConfig, url: str, model: str, out: Path, hf_home: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(hf_home)}
    cmd = [c.aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", c.endpoint,
           "--streaming", "--tokenizer", TOKENIZER_REPO, "--request-rate", str(c.request_rate),
           "--arrival-pattern", "constant", "--request-count", str(c.request_count),
           "--isl", str(c.input_tokens), "--isl-stddev", "0", "--osl", str(c.output_tokens),
           "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--use-server-token-count", "--no-server-metrics", "--no-gpu-telemetry",
           "--random-seed", "0", "--artifact-dir", str(out), "--export-level", "records",
           "--ui", "none"]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "aiperf.log").open("w") as logf:
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                              stderr=subprocess.STDOUT, timeout=c.timeout_s, check=False)
    if done.returncode != 0:
        tail = (out / "aiperf.log").read_text().strip().splitlines()[-5:]
        exit_with(1, f"aiperf failed (exit {done.returncode}); the end of its log "
                     f"({out / 'aiperf.log'}):\n" + "\n".join(tail))


def client_records(out: Path) -> pd.DataFrame:
    """aiperf's per-request records, in the order they were sent (ms)."""
    rows = []
    for line in (out / "profile_export.jsonl").open():
        rec = json.loads(line)
        md, m = rec["metadata"], rec["metrics"]
        value = lambda k, m=m: m[k]["value"] if k in m else None
        rows.append({"sent_ns": md["request_start_ns"], "error": rec.get("error"),
                     "ttft_ms": value("time_to_first_token"),
                     "e2e_ms": value("request_latency"),
                     "tpot_ms": value("inter_token_latency"),
                     "output_len": value("output_sequence_length"),
                     "prompt_len": value("input_sequence_length")})
    return pd.DataFrame(rows).sort_values("sent_ns", ignore_index=True)


def compare(client: pd.DataFrame, requests: pd.DataFrame, speed: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per request (sent order = arrival order) and the headline table: mean, median and
    p99 of TTFT, TPOT and E2E latency as aiperf measured them and as the simulator ran them
    (its simulated ms / speed)."""
    served = requests[requests["status"] == "finished"].sort_values("arrival_time",
                                                                    ignore_index=True)
    if len(served) != len(client) or client["error"].notna().any():
        raise RuntimeError(f"aiperf recorded {len(client)} requests "
                           f"({client['error'].notna().sum()} failed), the server finished "
                           f"{len(served)}")
    per = pd.DataFrame({
        "request_id": served["request_id"], "prompt_len": served["prompt_len"],
        "output_len": served["output_len"],
        "client_ttft_ms": client["ttft_ms"], "sim_ttft_ms": served["ttft"] * 1e3 / speed,
        "client_tpot_ms": client["tpot_ms"], "sim_tpot_ms": served["tpot"] * 1e3 / speed,
        "client_e2e_ms": client["e2e_ms"], "sim_e2e_ms": served["e2e_latency"] * 1e3 / speed})
    # Paired in sending order; aiperf reports the server's own token counts (usage), so a
    # pair whose prompt or output length differs was paired wrongly.
    for col in ("output_len", "prompt_len"):
        if not (client[col].to_numpy() == served[col].to_numpy()).all():
            raise RuntimeError(f"aiperf's {col} per request differs from the server's "
                               f"requests.csv in sending order")
    table = []
    for name in ("ttft", "tpot", "e2e"):
        a, b = per[f"client_{name}_ms"].to_numpy(), per[f"sim_{name}_ms"].to_numpy()
        for stat, f in (("mean", np.mean), ("median", np.median),
                        ("p99", lambda x: np.percentile(x, 99))):
            table.append({"metric": f"{stat}_{name}_ms", "aiperf": f(a), "simulator": f(b),
                          "difference_ms": f(a) - f(b)})
        gap = a - b
        table.append({"metric": f"{name}: per-request |aiperf - simulator|, median",
                      "aiperf": None, "simulator": None,
                      "difference_ms": float(np.median(np.abs(gap)))})
    return per, pd.DataFrame(table)


def main_job(cfg: DictConfig) -> pd.DataFrame:
    from online.launch import serving

    container = resolved(cfg)
    c = LoadgenConfig.from_dict(container.get("loadgen"))
    speed = float((container.get("serve") or {}).get("speed", 1.0))
    python = aiperf_python(c.aiperf)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_home = out_dir / "hf"
    tokenizer = Path(__file__).resolve().parent.parent / "online" / "local_tokenizer.py"
    built = subprocess.run([str(python), str(tokenizer), str(hf_home), TOKENIZER_REPO],
                           capture_output=True, text=True, check=False)
    if built.returncode != 0:
        exit_with(1, f"building aiperf's tokenizer failed:\n{built.stderr.strip()}")
    overrides = [o for o in HydraConfig.get().overrides.task
                 if not o.lstrip("+~").startswith(("loadgen.", "hydra."))]
    with serving(out_dir / "server", *overrides, "overwrite=true") as s:
        import urllib.request

        with urllib.request.urlopen(f"{s.url}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        log.info(f"aiperf: {c.request_count} requests at {c.request_rate:g}/s against {s.url}")
        run_aiperf(c, s.url, model, out_dir / "aiperf", hf_home)
    if s.returncode != 0:
        exit_with(1, "the server failed:\n" + "\n".join(s.output[-10:]))
    per, table = compare(client_records(out_dir / "aiperf"),
                         pd.read_csv(out_dir / "server" / "requests.csv"), speed)
    per.to_csv(out_dir / "loadgen.csv", index=False)
    text = markdown_table([{k: "" if v is None or (isinstance(v, float) and math.isnan(v))
                            else f"{v:.2f}" if isinstance(v, float) else v
                            for k, v in row.items()} for row in table.to_dict("records")])
    (out_dir / "loadgen.md").write_text(text + "\n")
    log.info(text)
    log.info(f"outputs: {out_dir}")
    return table


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve_loadgen")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        main_job(cfg)


if __name__ == "__main__":
    with hydra_errors_as_config_errors():
        main()
