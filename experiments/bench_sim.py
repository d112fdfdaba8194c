"""Simulator speed benchmark against Vidur's published figures (prints one table).

The anchor: Vidur simulated Llama-3-8B fp16 on one A100-80GB, TP1, block size 16, vLLM-style
scheduling with at most 128 running requests and 4,096 batched tokens, Poisson arrivals at
6 req/s, total length uniform in [256, 2048] split prefill:decode = 3:1, seed 42, in 37 s /
1.2 GB for 10,000 requests and 292 s / 2.4 GB for 100,000 requests on this kind of machine.
The table runs that recipe (without steps.csv, streaming ITL percentiles from 100k requests)
for every policy, both preemption modes on a pool that binds, four replicas behind a router
and a disaggregated deployment (``CASES``). Each case runs in its own process so its peak
memory (max RSS, interpreter and imports included) is its own.

    python -m experiments.bench_sim                                  # the eight cases at 100k
    python -m experiments.bench_sim --cases fcfs fcfs_kv3000 --sizes 1000000
    python -m experiments.bench_sim --cases fcfs --sizes 10000 --step-mode exact
    python -m experiments.bench_sim --cases fcfs sjf_noisy --sizes 10000 --steps-csv on
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

_FCFS = ["policy=fcfs", "policy.max_num_seqs=128", "policy.max_num_batched_tokens=4096"]
# Each case: its overrides on top of the recipe, and its arrival rate (req/s).
CASES: dict[str, tuple[list[str], float]] = {
    "fcfs": (_FCFS, 6),
    # Sarathi-Serve with chunk 512.
    "chunked_prefill": (["policy=chunked_prefill", "policy.max_num_seqs=128",
                         "policy.max_num_batched_tokens=512"], 6),
    # The same limits with the other orderings: shortest predicted output first (oracle, and
    # the noisy predictor whose order moves as it is used up) and priority classes (the
    # workload has none: priority order is arrival order).
    "sjf": (["policy=sjf", "policy.max_num_seqs=128", "policy.max_num_batched_tokens=4096"], 6),
    "sjf_noisy": (["policy=sjf", "policy.predictor=noisy", "policy.max_num_seqs=128",
                   "policy.max_num_batched_tokens=4096"], 6),
    "priority": (["policy=priority", "policy.max_num_seqs=128",
                  "policy.max_num_batched_tokens=4096"], 6),
    # A pool that binds: 3,000 blocks of 16 tokens hold about 40 of the recipe's requests, so
    # the batch is cut by preemption, by recompute or by swap.
    "fcfs_kv3000": ([*_FCFS, "kv.num_gpu_blocks_override=3000"], 6),
    "fcfs_kv3000_swap": ([*_FCFS, "kv.num_gpu_blocks_override=3000",
                          "policy.preemption_mode=swap"], 6),
    # vLLM's automatic prefix caching on the same recipe (no prompt shares a prefix).
    "fcfs_prefix_cache": ([*_FCFS, "kv.enable_prefix_caching=true"], 6),
    # vLLM v1's scheduler (prefix caching on) with the recipe's limits.
    "vllm_v1": (["policy=vllm_v1", "policy.max_num_seqs=128",
                 "policy.max_num_batched_tokens=4096"], 6),
    # vLLM v1 on the pool that binds (preemption by recompute; a recomputed request finds
    # what is left of its own blocks in the prefix cache).
    "vllm_v1_kv3000": (["policy=vllm_v1", "policy.max_num_seqs=128",
                        "policy.max_num_batched_tokens=4096", "kv.num_gpu_blocks_override=3000"],
                       6),
    # vLLM v1's priority scheduling, two classes of equal weight.
    "vllm_v1_priority": (["policy=vllm_v1", "policy.max_num_seqs=128",
                          "policy.max_num_batched_tokens=4096",
                          "policy.scheduling_policy=priority", "+workload.priorities=[1,1]"],
                         6),
    # The same on the pool that binds: victims by priority.
    "vllm_v1_priority_kv3000": (["policy=vllm_v1", "policy.max_num_seqs=128",
                                 "policy.max_num_batched_tokens=4096",
                                 "policy.scheduling_policy=priority", "+workload.priorities=[1,1]",
                                 "kv.num_gpu_blocks_override=3000"], 6),
    # vLLM v1 with its engine's limits on the recipe's GPU (256 sequences, 2,048 tokens):
    # a pool that could bind were every seat's request at its longest at once.
    "vllm_v1_defaults": (["policy=vllm_v1"], 6),
    # TensorRT-LLM's scheduler (guaranteed_no_evict: each request holds its whole length)
    # with the recipe's limits.
    "trtllm": (["policy=trtllm", "policy.max_num_seqs=128",
                "policy.max_num_batched_tokens=4096"], 6),
    # SGLang's scheduler (radix cache on) with the recipe's limits.
    "sglang": (["policy=sglang", "policy.max_num_seqs=128", "policy.max_num_batched_tokens=4096",
                "policy.chunked_prefill_size=4096"], 6),
    # SGLang on the pool that binds (retraction by recompute, to the queue's tail).
    "sglang_kv3000": (["policy=sglang", "policy.max_num_seqs=128",
                       "policy.max_num_batched_tokens=4096", "policy.chunked_prefill_size=4096",
                       "kv.num_gpu_blocks_override=3000"], 6),
    # Static batching (batches of 128, each request holding its whole length), the baseline.
    "static": (["policy=static", "policy.max_num_seqs=128",
                "policy.max_num_batched_tokens=4096"], 6),
    # Two pipeline stages per replica (two micro-batches in flight).
    "fcfs_pp2": ([*_FCFS, "cluster.pipeline_parallel_size=2"], 6),
    # Sarathi-Serve's chunks (512 tokens) on two pipeline stages, as Vidur pairs them.
    "chunked_prefill_pp2": (["policy=chunked_prefill", "policy.max_num_seqs=128",
                             "policy.max_num_batched_tokens=512",
                             "cluster.pipeline_parallel_size=2"], 6),
    # TensorRT-LLM's scheduler (each request holding its whole length) on two stages.
    "trtllm_pp2": (["policy=trtllm", "policy.max_num_seqs=128",
                    "policy.max_num_batched_tokens=4096", "cluster.pipeline_parallel_size=2"],
                   6),
    # vLLM v1's scheduler (prefix caching on) on two stages.
    "vllm_v1_pp2": (["policy=vllm_v1", "policy.max_num_seqs=128",
                     "policy.max_num_batched_tokens=4096", "cluster.pipeline_parallel_size=2"],
                    6),
    # Four replicas behind a router at four times the rate.
    "replicas4": ([*_FCFS, "cluster.num_replicas=4", "cluster.router=least_outstanding"], 24),
    # The same behind the router that reads each replica's KV usage at every arrival.
    "replicas4_kv": ([*_FCFS, "cluster.num_replicas=4", "cluster.router=least_kv"], 24),
    # Two prefill and two decode replicas at twice the rate.
    "disagg2x2": ([*_FCFS, "cluster=disaggregated", "cluster.num_prefill_replicas=2",
                   "cluster.num_decode_replicas=2"], 12),
    # The same with two pipeline stages per replica in both pools.
    "disagg2x2_pp2": ([*_FCFS, "cluster=disaggregated", "cluster.num_prefill_replicas=2",
                       "cluster.num_decode_replicas=2", "cluster.pipeline_parallel_size=2"],
                      12),
}
# The one table the speed targets are read from: every policy, preemption mode and layout.
DEFAULT_CASES = ["fcfs", "chunked_prefill", "sjf", "priority", "fcfs_kv3000",
                 "fcfs_kv3000_swap", "replicas4", "disagg2x2"]
# Wall-time targets by size (seconds): >= 50x Vidur at 100k, and 1M within a minute.
TARGET_S = {100_000: 5.8, 1_000_000: 60.0}
STEPS_CSV = ("auto", "on", "off")


def case_overrides(case: str, n: int, step_mode: str, out_dir: Path,
                   steps_csv: str = "auto") -> list[str]:
    """The run's overrides. ``steps_csv``: auto (``steps.csv`` up to 200k requests), on, off."""
    if steps_csv not in STEPS_CSV:
        raise ValueError(f"steps_csv must be one of {STEPS_CSV}, got {steps_csv!r}")
    # Exact ITL percentiles keep 8 bytes per token (230 MB at 100k requests, and a copy to
    # sort): from 100k on the ITL distribution is a streaming histogram (0.1% relative).
    # Million-request runs keep no per-step history either.
    streaming = n >= 100_000
    no_steps = n > 200_000 if steps_csv == "auto" else steps_csv == "off"
    return ["model=llama3_8b", "hardware=a100_80gb", "cluster.tensor_parallel_size=1",
            "kv.block_size=16", "workload=vidur_bench", f"workload.num_requests={n}",
            f"workload.qps={CASES[case][1]:g}", "seed=42", f"step_mode={step_mode}", "progress=false",
            f"itl_quantiles={'streaming' if streaming else 'exact'}",
            f"record_steps={'false' if no_steps else 'true'}", *CASES[case][0]]


def run_case(case: str, n: int, step_mode: str, out_dir: Path,
             steps_csv: str = "auto") -> dict:
    """Runs in a child process: build, simulate (rows written as requests finish), report."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.simulation import Simulation

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=case_overrides(case, n, step_mode, out_dir, steps_csv))
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    t0 = time.perf_counter()
    sim = Simulation(container, out_dir)
    s = sim.run().summary
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"case": case, "requests": n, "step_mode": step_mode, "wall_s": wall,
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
    ap.add_argument("--sizes", type=_request_count, nargs="+", default=[100_000])
    ap.add_argument("--cases", "--policies", dest="cases", nargs="+", default=DEFAULT_CASES,
                    choices=list(CASES), help="cases to run (default: the eight of the table)")
    ap.add_argument("--step-mode", default="fast", choices=["fast", "exact"])
    ap.add_argument("--steps-csv", default="off", choices=STEPS_CSV,
                    help="write steps.csv: off (the default, as in the recipe), on, or auto "
                         "(up to 200k requests)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_sim"))
    ap.add_argument("--one", nargs=2, metavar=("CASE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        case, n = args.one[0], int(args.one[1])
        out = Path(args.out) / f"{case}_{n}_{args.step_mode}"
        print(json.dumps(run_case(case, n, args.step_mode, out, args.steps_csv)))
        return

    rows = []
    for n in args.sizes:
        for case in args.cases:
            p = subprocess.run([sys.executable, "-m", "experiments.bench_sim", "--one", case,
                                str(n), "--step-mode", args.step_mode, "--steps-csv",
                                args.steps_csv, "--out", args.out],
                               cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"{case} x {n} failed:\n{p.stderr}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"  done {case} x {n}: {r['wall_s']:.1f} s", file=sys.stderr)

    print(f"\nSimulator speed (step_mode={args.step_mode}; Llama-3-8B fp16, A100-80GB, TP1, "
          f"Poisson arrivals, total length U[256, 2048] split 3:1, seed 42)\n")
    head = (f"{'case':<18}{'req/s in':>9}{'requests':>10}{'wall s':>9}{'steps':>11}"
            f"{'jumps':>11}{'steps/s':>10}{'peak MB':>9}{'vs Vidur':>10}{'target':>9}  engine; "
            f"medians TTFT / TPOT / E2E (ms)")
    print(head)
    print("-" * len(head))
    for r in rows:
        n, wall = r["requests"], r["wall_s"]
        vidur_wall = VIDUR.get(n, (None,))[0]
        if vidur_wall is None:  # no published figure: Vidur's 100k rate (342 req/s)
            vidur_wall = n / (100_000 / VIDUR[100_000][0])
            ratio = f"{vidur_wall / wall:.0f}x*"
        else:
            ratio = f"{vidur_wall / wall:.0f}x"
        target = TARGET_S.get(n)
        met = "" if target is None else ("met" if wall <= target else "missed")
        print(f"{r['case']:<18}{CASES[r['case']][1]:>9g}{n:>10,}{wall:>9.2f}{r['steps']:>11,}"
              f"{r['jumps']:>11,}{r['steps'] / wall:>10,.0f}{r['peak_mb']:>9.0f}{ratio:>10}{met:>9}  "
              f"{r['engine']}; {r['median_ttft_ms']:.0f} / {r['median_tpot_ms']:.1f} / "
              f"{r['median_e2e_ms']:.0f}"
              + ("" if r["record_steps"] else "   (no steps.csv)")
              + ("   (streaming ITL)" if r.get("streaming") else ""))
    print("\nvs Vidur: Vidur's wall time / ours (10k: 37 s, 100k: 292 s; * = at Vidur's 100k "
          "rate of 342 req/s). target: <= 5.8 s at 100k (50x Vidur), <= 60 s at 1M. Vidur's "
          "own medians for orientation: TTFT ~100 ms, TPOT ~34 ms, E2E ~9.8 s (its attention "
          "model is its own).")
    fcfs_wall = {r["requests"]: r["wall_s"] for r in rows if r["case"] == "fcfs"}
    for n, w in fcfs_wall.items():
        chunked = next((r["wall_s"] for r in rows
                        if r["case"] == "chunked_prefill" and r["requests"] == n), None)
        if chunked is not None:
            print(f"chunked_prefill / fcfs wall time at {n:,}: {chunked / w:.2f}x")


if __name__ == "__main__":
    main()
