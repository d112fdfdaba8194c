"""What the literature predicts for each compare_policies scenario, checked against the table.

A check never fails the run: it states the claim, whether the figures agree, and the figures,
so a contradiction is reported (and explained in docs/policies.md), not tuned away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.simulation import Simulation
from sim.plan import ScheduledRequest, StepPlan


@dataclass
class Check:
    claim: str
    holds: bool
    detail: str


def _row(table: pd.DataFrame, label: str) -> pd.Series | None:
    rows = table[table.policy == label]
    return None if rows.empty else rows.iloc[0]


def static_slot_use(requests: pd.DataFrame) -> tuple[float, int]:
    """Fraction of a static batch's decode row-steps that produce a token: sum of output
    lengths over sum of (batch size x longest output) per batch. Its inverse is the seeds'
    L_max / L_mean guide, measured on the batches this run formed. Also the batch count."""
    done = requests[requests.status == "finished"].sort_values("first_scheduled_time")
    useful = reserved = 0.0
    batches, end, size, longest = 0, float("-inf"), 0, 0
    for start, finish, out in zip(done.first_scheduled_time, done.finish_time, done.output_len):
        if start >= end:  # the previous batch had ended: this request opens a new one
            reserved += size * longest
            batches, end, size, longest = batches + 1, finish, 0, 0
        end, size, longest = max(end, finish), size + 1, max(longest, out)
        useful += out
    reserved += size * longest
    return (useful / reserved if reserved else 1.0), batches


def varied_outputs(t: pd.DataFrame, out: Path, sims: dict) -> list[Check]:
    cb, st = _row(t, "fcfs"), _row(t, "static")
    if cb is None or st is None:
        return []
    reqs = pd.read_csv(out / "static" / "requests.csv")
    use, batches = static_slot_use(reqs)
    lens = reqs[reqs.status == "finished"].output_len
    factor = cb.output_throughput / st.output_throughput
    steps = {v: decode_steps(out / v / "steps.csv") for v in ("fcfs", "static")}
    return [Check(
        "continuous batching (fcfs) beats static batching in throughput by a large factor",
        factor >= 1.5,
        f"output throughput {cb.output_throughput:.0f} vs {st.output_throughput:.0f} tok/s: "
        f"x{factor:.2f}; fcfs mean TTFT {cb.mean_ttft_ms:.0f} ms (static "
        f"{st.mean_ttft_ms / 1e3:.1f} s); workload L_max/L_mean = {lens.max()}/{lens.mean():.0f} = "
        f"{lens.max() / lens.mean():.1f}; on the {batches} static batches formed, "
        f"1/(useful row-steps / batch x longest) = {1 / use:.1f}; decode-only steps: fcfs "
        f"{steps['fcfs']}, static {steps['static']}")]


def decode_steps(path: Path) -> str:
    """Count, mean duration and mean batch of the decode-only steps, and the prefill time."""
    s = pd.read_csv(path)
    d = s[s.prefill_tokens == 0]
    return (f"{len(d)} x {1e3 * d.duration.mean():.1f} ms (mean batch {d.batch_size.mean():.0f}), "
            f"prefill-carrying steps {s[s.prefill_tokens > 0].duration.sum():.0f} s")


def long_prompts(t: pd.DataFrame, out: Path, sims: dict) -> list[Check]:
    cp, fc = _row(t, "chunked_prefill"), _row(t, "fcfs")
    if cp is None or fc is None:
        return []
    return [Check(
        "chunked prefill cuts p99 ITL versus FCFS",
        cp.p99_itl_ms < fc.p99_itl_ms,
        f"p99 ITL {cp.p99_itl_ms:.1f} vs {fc.p99_itl_ms:.1f} ms "
        f"(x{fc.p99_itl_ms / cp.p99_itl_ms:.1f}); mean TTFT {cp.mean_ttft_ms:.0f} vs "
        f"{fc.mean_ttft_ms:.0f} ms")]


def aged_share(out: Path, label: str, sims: dict, scenario: str) -> str:
    """The share of a SJF variant's requests first scheduled after waiting ``aging_s`` or
    more: those were served in arrival order, as under FCFS, so the more of them, the less
    SJF can differ from FCFS."""
    sim = sims.get((scenario, label))
    aging = getattr(sim.policy.config, "aging_s", None) if sim is not None else None
    if aging is None:
        return ""
    r = pd.read_csv(out / label / "requests.csv")
    waited = (r.first_scheduled_time - r.arrival_time).dropna()
    return f"; {(waited >= aging).mean():.0%} of {label}'s requests waited >= aging_s {aging:g} s"


def high_load(t: pd.DataFrame, out: Path, sims: dict) -> list[Check]:
    fc, oracle = _row(t, "fcfs"), _row(t, "sjf_oracle")
    if fc is None or oracle is None:
        return []
    checks = []
    aged = aged_share(out, "sjf_oracle", sims, "high_load")
    for stat in ("mean", "median"):
        k = f"{stat}_e2el_ms"
        checks.append(Check(f"SJF (oracle) cuts {stat} E2E latency versus FCFS",
                            oracle[k] < fc[k], f"{oracle[k]:.0f} vs {fc[k]:.0f} ms; fcfs mean "
                            f"TTFT {fc.mean_ttft_ms / 1e3:.1f} s{aged}"))
        for label in ("sjf_noisy", "sjf_bucket"):
            r = _row(t, label)
            if r is not None:
                checks.append(Check(
                    f"{label} lands between oracle and FCFS in {stat} E2E",
                    oracle[k] <= r[k] <= fc[k],
                    f"oracle {oracle[k]:.0f} <= {r[k]:.0f} <= fcfs {fc[k]:.0f} ms"))
    return checks


def per_token_costs(sim: Simulation) -> tuple[float, float]:
    """Seconds per token of context to swap out and back in over PCIe, and to recompute it
    (one prefill of the workload's median-length prompt, per token), from the cost model."""
    ex, bs = sim.executor, sim.kv_cfg.block_size
    pairs = [(i, i) for i in range(64)]
    swap = ex.breakdown(StepPlan(swap_out=pairs, swap_in=pairs)).swap / (64 * bs)
    p = int(getattr(sim.workload.prompt_len, "median", 0) or 1000)
    row = ScheduledRequest(0, 0, p, list(range(-(-p // bs))), True)
    prefill = ex.breakdown(StepPlan([row])).total / p
    return swap, prefill


def small_kv(t: pd.DataFrame, out: Path, sims: dict) -> list[Check]:
    checks = []
    for base in ("fcfs", "chunked_prefill"):
        rec, swp = _row(t, base), _row(t, f"{base}_swap")
        if rec is None or swp is None or (base, "small_kv") not in {(v, s) for s, v in sims}:
            continue
        swap_s, recompute_s = per_token_costs(sims[("small_kv", base)])
        swap_cheaper = swap_s < recompute_s
        better = swp.mean_e2el_ms < rec.mean_e2el_ms
        checks.append(Check(
            f"{base}: swap and recompute differ as PCIe vs prefill cost predict "
            f"({'swap' if swap_cheaper else 'recompute'} cheaper per token)",
            better == swap_cheaper and rec.num_preemptions > 0,
            f"per token of context: swap out+in {1e6 * swap_s:.1f} us, recompute "
            f"{1e6 * recompute_s:.1f} us; mean E2E swap {swp.mean_e2el_ms:.0f} vs recompute "
            f"{rec.mean_e2el_ms:.0f} ms; throughput {swp.request_throughput:.2f} vs "
            f"{rec.request_throughput:.2f} req/s; preemptions swap-mode "
            f"{swp.num_preemptions} ({swp.num_swaps} swaps, {swp.num_recomputes} recomputes, "
            f"{swp.num_swap_fallbacks} fallbacks) vs recompute-mode {rec.num_preemptions}"))
    return checks


CHECKS: dict[str, Callable[[pd.DataFrame, Path, dict], list[Check]]] = {
    "varied_outputs": varied_outputs,
    "long_prompts": long_prompts,
    "high_load": high_load,
    "small_kv": small_kv,
}
