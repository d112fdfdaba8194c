"""Simulator speed benchmark against Vidur's published figures (prints a table).

The anchor (issue: simulator speed): Vidur simulated Llama-3-8B fp16 on one A100-80GB, TP1,
block size 16, vLLM-style scheduling with at most 128 running requests and 4,096 batched
tokens, Poisson arrivals at 6 req/s, total length uniform in [256, 2048] split prefill:decode
= 3:1, seed 42, in 37 s / 1.2 GB for 10,000 requests and 292 s / 2.4 GB for 100,000 requests
on this kind of machine. Each case here runs in its own process so its peak memory (max RSS,
interpreter and imports included) is its own. Results: docs/performance.md.

    python -m experiments.bench_sim                                  # 10k and 100k, fcfs + chunked
    python -m experiments.bench_sim --sizes 10000 100000 1000000     # the full table
    python -m experiments.bench_sim --policies fcfs --sizes 10000 --step-mode exact
    python -m experiments.bench_sim --policies fcfs sjf sjf_noisy priority --sizes 10000
    python -m experiments.bench_sim --sizes 100000 --steps-csv off   # the loop without steps.csv
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIDUR = {10_000: (37.0, 1200), 100_000: (292.0, 2400)}  # wall s, peak MB
VIDUR_MEDIANS = {"ttft_ms": 100.0, "tpot_ms": 34.0, "e2e_ms": 9800.0}

POLICY_OVERRIDES = {
    "fcfs": ["policy=fcfs", "policy.max_num_seqs=128", "policy.max_num_batched_tokens=4096"],
    # Sarathi-Serve with chunk 512.
    "chunked_prefill": ["policy=chunked_prefill", "policy.max_num_seqs=128",
                        "policy.max_num_batched_tokens=512"],
    # The same limits with the other orderings (not run by default): shortest predicted
    # output first (oracle, and the noisy predictor whose order moves as it is used up) and
    # priority classes (the workload has none: priority order is arrival order).
    "sjf": ["policy=sjf", "policy.max_num_seqs=128", "policy.max_num_batched_tokens=4096"],
    "sjf_noisy": ["policy=sjf", "policy.predictor=noisy", "policy.max_num_seqs=128",
                  "policy.max_num_batched_tokens=4096"],
    "priority": ["policy=priority", "policy.max_num_seqs=128",
                 "policy.max_num_batched_tokens=4096"],
}
DEFAULT_POLICIES = ["fcfs", "chunked_prefill"]  # the two
STEPS_CSV = ("auto", "on", "off")


def case_overrides(policy: str, n: int, step_mode: str, out_dir: Path,
                   steps_csv: str = "auto") -> list[str]:
    """The run's overrides. ``steps_csv``: auto (``steps.csv`` up to 200k requests), on, off."""
    if steps_csv not in STEPS_CSV:
        raise ValueError(f"steps_csv must be one of {STEPS_CSV}, got {steps_csv!r}")
    # Exact ITL percentiles keep 8 bytes per token (230 MB at 100k requests, and a copy to
    # sort): from 100k on the ITL distribution is a streaming histogram (0.1% relative).
    # Million-request runs keep no per-step history either.
    streaming = n >= 100_000
    no_steps = n > 200_000 if steps_csv == "auto" else steps_csv == "off"
    return ["model=llama3_8b", "hardware=a100_80gb", "cluster.tensor_parallel=1",
            "kv.block_size=16", "workload=vidur_bench", f"workload.num_requests={n}",
            "workload.qps=6", "seed=42", f"step_mode={step_mode}", "progress=false",
            f"itl_quantiles={'streaming' if streaming else 'exact'}",
            f"record_steps={'false' if no_steps else 'true'}", *POLICY_OVERRIDES[policy]]


def run_case(policy: str, n: int, step_mode: str, out_dir: Path,
             steps_csv: str = "auto") -> dict:
    """Runs in a child process: build, simulate (rows written as requests finish), report."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sim.simulation import Simulation

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=case_overrides(policy, n, step_mode, out_dir, steps_csv))
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    t0 = time.perf_counter()
    sim = Simulation(container, out_dir)
    s = sim.run().summary
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"policy": policy, "requests": n, "step_mode": step_mode, "wall_s": wall,
            "steps": s["num_steps"], "jumps": s.get("num_decode_jumps", 0), "peak_mb": peak_mb,
            "completed": s["completed"], "median_ttft_ms": s["median_ttft_ms"],
            "median_tpot_ms": s["median_tpot_ms"], "median_e2e_ms": s["median_e2el_ms"],
            "record_steps": container["record_steps"], "engine": s["step_engine"],
            "streaming": container["itl_quantiles"] == "streaming"}


def _request_count(text: str) -> int:
    """A ``--sizes`` value: a whole number of requests, at least 1 (argparse's error else)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=_request_count, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES,
                    choices=list(POLICY_OVERRIDES))
    ap.add_argument("--step-mode", default="fast", choices=["fast", "exact"])
    ap.add_argument("--steps-csv", default="auto", choices=STEPS_CSV,
                    help="write steps.csv: auto (up to 200k requests, the default), on, off")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_sim"))
    ap.add_argument("--one", nargs=2, metavar=("POLICY", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        policy, n = args.one[0], int(args.one[1])
        out = Path(args.out) / f"{policy}_{n}_{args.step_mode}"
        print(json.dumps(run_case(policy, n, args.step_mode, out, args.steps_csv)))
        return

    rows = []
    for n in args.sizes:
        for policy in args.policies:
            p = subprocess.run([sys.executable, "-m", "experiments.bench_sim", "--one", policy,
                                str(n), "--step-mode", args.step_mode, "--steps-csv",
                                args.steps_csv, "--out", args.out],
                               cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"{policy} x {n} failed:\n{p.stderr}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"  done {policy} x {n}: {r['wall_s']:.1f} s", file=sys.stderr)

    print(f"\nSimulator speed (step_mode={args.step_mode}; Llama-3-8B fp16, A100-80GB, TP1, "
          f"Poisson 6 req/s, total length U[256, 2048] split 3:1, seed 42)\n")
    head = (f"{'policy':<16}{'requests':>10}{'wall s':>9}{'req/s':>9}{'steps':>11}"
            f"{'steps/s':>10}{'peak MB':>9}{'vs Vidur':>10}  medians TTFT / TPOT / E2E (ms)")
    print(head)
    print("-" * len(head))
    fcfs_wall = {r["requests"]: r["wall_s"] for r in rows if r["policy"] == "fcfs"}
    for r in rows:
        n, wall = r["requests"], r["wall_s"]
        vidur_wall = VIDUR.get(n, (None,))[0]
        if vidur_wall is None:  # no published figure: Vidur's 100k rate (342 req/s)
            vidur_wall = n / (100_000 / VIDUR[100_000][0])
            ratio = f"{vidur_wall / wall:.0f}x*"
        else:
            ratio = f"{vidur_wall / wall:.0f}x"
        print(f"{r['policy']:<16}{n:>10,}{wall:>9.2f}{n / wall:>9,.0f}{r['steps']:>11,}"
              f"{r['steps'] / wall:>10,.0f}{r['peak_mb']:>9.0f}{ratio:>10}  "
              f"{r['median_ttft_ms']:.0f} / {r['median_tpot_ms']:.1f} / {r['median_e2e_ms']:.0f}"
              + ("" if r["record_steps"] else "   (no steps.csv)")
              + ("   (streaming ITL)" if r.get("streaming") else "")
              + ("   (array core)" if r.get("engine") == "array_core" else ""))
    print("\nvs Vidur: Vidur's wall time / ours (10k: 37 s, 100k: 292 s; * = at Vidur's 100k "
          "rate of 342 req/s). Vidur's own medians for orientation: TTFT ~100 ms, TPOT ~34 ms, "
          "E2E ~9.8 s (its attention model is its own).")
    for n, w in fcfs_wall.items():
        chunked = next((r["wall_s"] for r in rows
                        if r["policy"] == "chunked_prefill" and r["requests"] == n), None)
        if chunked is not None:
            print(f"chunked_prefill / fcfs wall time at {n:,}: {chunked / w:.2f}x")


if __name__ == "__main__":
    main()
