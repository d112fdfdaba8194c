"""Outputs do not depend on scheduling: the same requests through the real executor (tiny model,
CPU, greedy) give identical token sequences under every policy, chunked prefill, and forced
preemption by swap and by recompute. The shared abstraction is really shared."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("torch")

from experiments.simulation import Simulation  # noqa: E402
from policies import POLICIES  # noqa: E402
from tests.helpers import compose_cfg  # noqa: E402

TINY_POOL = ("kv.num_gpu_blocks_override=8",)  # 128 tokens for 12 requests of up to 100: preemption

# Configurations per policy name; a name registered but not listed here runs with its
# defaults, a name listed but not registered (a policy from another branch) is skipped.
CONFIGS: dict[str, dict[str, tuple[str, ...]]] = {
    "fcfs": {
        "plain": (),
        "swap": ("policy.preemption_mode=swap", *TINY_POOL),
        "recompute": ("policy.preemption_mode=recompute", *TINY_POOL),
    },
    # Prompts of 5-60 tokens against 16-32-token budgets: most are prefilled in chunks.
    "chunked_prefill": {
        "plain": ("policy.max_num_batched_tokens=16", "policy.max_num_seqs=16"),
        "recompute": ("policy.max_num_batched_tokens=24", "policy.max_num_seqs=16",
                      "policy.preemption_mode=recompute", *TINY_POOL),
        "swap": ("policy.max_num_batched_tokens=32", "policy.max_num_seqs=16",
                 "policy.preemption_mode=swap", *TINY_POOL),
    },
    "sjf": {
        "plain": (),
        "recompute": ("policy.preemption_mode=recompute", *TINY_POOL),
    },
    "static": {
        "plain": ("policy.max_num_seqs=4",),
    },
    "priority": {
        "swap": ("policy.preemption_mode=swap", *TINY_POOL),
    },
}
CASES = [(name, label) for name in sorted(set(CONFIGS) | set(POLICIES.names()))
         for label in CONFIGS.get(name, {"default": ()})]


def run(*overrides: str, out_dir=None):
    # Small pools keep the per-step integrity check cheap; all requests arrive at once.
    cfg = compose_cfg("executor=real", "device=cpu", "model=tiny", "seed=3",
                      "check_integrity=true", "workload.num_requests=12", "workload.qps=1000",
                      "kv.num_gpu_blocks_override=256", "kv.num_cpu_blocks=64", *overrides)
    cfg["workload"]["prompt_len"] = {"dist": "uniform", "min": 5, "max": 60}
    cfg["workload"]["output_len"] = {"dist": "uniform", "min": 8, "max": 40}
    res = Simulation(cfg, out_dir, keep_requests=True).run()
    assert res.summary["completed"] == 12, res.summary
    return res, {r.request_id: list(r.output_token_ids) for r in res.requests}


@pytest.fixture(scope="module")
def baseline():
    return run()[1]


@pytest.mark.parametrize("name,label", CASES)
def test_greedy_outputs_do_not_depend_on_scheduling(name, label, baseline):
    if name not in POLICIES.names():
        pytest.skip(f"policy {name!r} is not registered in this build")
    # A policy with no configurations here runs with its defaults: checked, never skipped.
    res, outs = run(f"policy={name}", *CONFIGS.get(name, {"default": ()})[label])
    assert outs == baseline
    for r in res.requests:
        assert len(r.output_token_ids) == r.max_output_len
    s = res.summary
    if "swap" in label:
        assert s["num_preemptions"] > 0 and res.metrics.num_swaps > 0
    if "recompute" in label:
        assert s["num_preemptions"] > 0 and res.metrics.num_recomputes > 0
    if name == "chunked_prefill":
        # Chunked for real: prefill tokens per step within the budget, and some steps carry
        # prompt chunks and decodes together.
        cols = res.steps_sink.columns
        pre, dec = cols.index("prefill_tokens"), cols.index("decode_tokens")
        budget = int(next(o for o in CONFIGS[name][label] if "batched" in o).split("=")[1])
        assert max(row[pre] for row in res.steps_sink.rows) <= budget
        assert any(row[pre] and row[dec] for row in res.steps_sink.rows)


def test_requests_csv_carries_the_generated_ids(tmp_path):
    res, outs = run(out_dir=tmp_path)
    df = pd.read_csv(tmp_path / "requests.csv", dtype={"output_token_ids": str})
    assert len(df) == 12
    for _, row in df.iterrows():
        ids = [int(t) for t in row.output_token_ids.split()]
        assert ids == outs[row.request_id] and len(ids) == row.output_len
    assert res.summary["hardware"] == "cpu" and res.summary["executor"] == "real"
    # The planner sized blocks with the executor's fp32 KV (2 layers x 2 x 64 x 4 bytes).
    assert res.summary["kv_bytes_per_token"] == 1024


# Every request arrives during the first step (1 ns apart), however long the measured steps
# take: the cache hits and offload loads asserted below do not depend on the host's speed.
SHARED = ("workload.shared_prefix_len=40", "workload.num_prefix_groups=2",
          "workload.arrival=constant", "workload.qps=1e9")


@pytest.fixture(scope="module")
def shared_baseline():
    res, outs = run(*SHARED, "kv.enable_prefix_caching=false")
    assert res.summary["prefix_cache_hits"] == 0
    return outs


@pytest.mark.parametrize("overrides", [
    ("policy=fcfs",),
    ("policy=fcfs", "policy.preemption_mode=recompute", *TINY_POOL),
    ("policy=chunked_prefill", "policy.max_num_batched_tokens=16", "policy.max_num_seqs=16"),
    ("policy=sjf", "policy.preemption_mode=swap", *TINY_POOL),
    ("policy=vllm_v1", "policy.max_num_batched_tokens=24"),
    ("policy=vllm_v1", *TINY_POOL),
])
def test_greedy_outputs_do_not_depend_on_prefix_cache_hits(overrides, shared_baseline):
    """Prompts that start with one of two shared 40-token prefixes (equal ids): a request
    handed the cached blocks of its prefix skips computing them in the real model, and
    generates exactly what it generates with caching off."""
    res, outs = run(*SHARED, "kv.enable_prefix_caching=true", *overrides)
    assert res.summary["prefix_cache_hits"] > 0
    assert outs == shared_baseline


@pytest.mark.parametrize("overrides", [
    ("policy=vllm_v1", *TINY_POOL),
    ("policy=fcfs", "policy.preemption_mode=recompute", *TINY_POOL),
    ("policy=sjf", "policy.preemption_mode=swap", "kv.num_gpu_blocks_override=10"),
])
def test_greedy_outputs_do_not_depend_on_offload_loads(overrides, shared_baseline):
    """A tight GPU pool evicts the shared prefixes; the offload tier keeps their KV in host
    memory and a later request loads it back (real copies) instead of computing it: the
    tokens are those generated with caching off."""
    res, outs = run(*SHARED, "kv.enable_prefix_caching=true", "kv.num_offload_blocks=16",
                    *overrides)
    assert res.summary["kv_offload_loads"] > 0, res.summary
    assert outs == shared_baseline
