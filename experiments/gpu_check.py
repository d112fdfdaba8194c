"""GPU validation of the real executor, in one call (needs CUDA; see docs/gpu-validation.md).

    python -m experiments.gpu_check [--out gpu_check.md] [--requests 200]

Run it first on a GPU (docs/gpu-validation.md, "Validation on a GPU": ~1.5 to 2 minutes,
the 200-request run about one of them); its table goes at the top of docs/gpu-validation.md.

1. every Triton kernel against its torch reference in bf16 at Llama-3-8B shapes;
2. achieved HBM bandwidth of the decode attention kernel at large batch x context, as a
   fraction of a measured device-to-device copy (target >= 70%);
3. a Llama-3-8B-shaped random-weight decode step at batch 1 and 64 against the weight-read
   floor (weight bytes / measured copy bandwidth; target <= 1.3x at batch 1);
4. an end-to-end run of N requests through the simulator with ``executor=real``.

Prints a markdown table (and writes it with ``--out``) with the device, driver and versions.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

from executors.real import RealExecutor, RealExecutorConfig
from executors.real.kernels import TORCH, TRITON, AttentionMetadata
from sim.kv_manager import KVBlockManager
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import load_model_spec

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=BF16, device=DEV)
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_time(lambda: dst.copy_(src))


def attention_case(num_seqs: int, ctx: int, q_len: int, hk: int = 8, group: int = 4,
                   d: int = 128, block_size: int = 16, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    blocks = -(-ctx // block_size)
    num_blocks = num_seqs * blocks
    perm = torch.randperm(num_blocks, device=DEV, generator=g).tolist()
    rows = [(ctx - q_len, q_len, perm[i * blocks:(i + 1) * blocks]) for i in range(num_seqs)]
    meta = AttentionMetadata.build(rows, block_size, DEV)
    cache = torch.randn(2, num_blocks, block_size, hk, d, device=DEV, generator=g).to(BF16)
    q = torch.randn(num_seqs * q_len, hk * group, d, device=DEV, generator=g).to(BF16)
    return q, cache, meta


def check_kernels() -> list[tuple[str, str, str]]:
    """(kernel, max abs error vs reference, verdict) in bf16."""
    out = []
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV, generator=g).to(BF16)

    def row(name, got, want, tol):
        err = (got.float() - want.float()).abs().max().item()
        out.append((name, f"{err:.2e}", "ok" if err <= tol else f"FAIL (tol {tol})"))

    for label, (n, ctx, ql) in {"attention decode": (32, 1000, 1),
                                "attention prefill": (4, 700, 300),
                                "attention chunk+ctx": (3, 2100, 512)}.items():
        q, cache, meta = attention_case(n, ctx, ql)
        row(label, TRITON.paged_attention(q, cache, meta), TORCH.paged_attention(q, cache, meta),
            2e-2)
    x, r, w = rnd(64, 4096), rnd(64, 4096), rnd(4096)
    row("rms_norm+residual", TRITON.rms_norm(x, w, 1e-5, r)[0], TORCH.rms_norm(x, w, 1e-5, r)[0],
        5e-2)
    xs = rnd(64, 2 * 14336)
    row("silu_mul", TRITON.silu_mul(xs), TORCH.silu_mul(xs), 5e-2)
    qkv = rnd(64, 48 * 128)
    pos = torch.randint(0, 8000, (64,), device=DEV, generator=g)
    inv = 1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEV).float() / 128)
    f = torch.outer(torch.arange(8192, device=DEV).float(), inv)
    cs = torch.cat([f.cos(), f.sin()], -1).contiguous()
    a, b = qkv.clone(), qkv.clone()
    for buf, k in ((a, TORCH), (b, TRITON)):
        k.rotary(buf[:, :4096].view(64, 32, 128), buf[:, 4096:5120].view(64, 8, 128), pos, cs)
    row("rotary", b, a, 5e-2)
    c1 = torch.zeros(2, 64, 16, 8, 128, dtype=BF16, device=DEV)
    c2 = c1.clone()
    slots = torch.randperm(64 * 16, device=DEV, generator=g)[:64]
    kv = qkv[:, 4096:].view(64, 2, 8, 128)
    TORCH.kv_store(kv[:, 0], kv[:, 1], c1, slots)
    TRITON.kv_store(kv[:, 0], kv[:, 1], c2, slots)
    row("kv_store", c2, c1, 0.0)
    return out


def decode_bandwidth(copy_bw: float, batch: int = 64, ctx: int = 4096) -> tuple[float, float]:
    """(achieved bytes/s, fraction of copy bandwidth) of decode attention."""
    q, cache, meta = attention_case(batch, ctx, 1)
    t = cuda_time(lambda: TRITON.paged_attention(q, cache, meta))
    hk, d = cache.shape[3], cache.shape[4]
    nbytes = 2 * batch * ctx * hk * d * 2 + 2 * q.numel() * 2  # K and V read, q read, out write
    return nbytes / t, nbytes / t / copy_bw


def decode_step(copy_bw: float, batch: int, ctx: int = 1024) -> tuple[float, float, float]:
    """(step seconds, weight-read floor seconds, ratio) for a Llama-3-8B bf16 decode step."""
    spec = load_model_spec("llama3_8b")
    ex = RealExecutor(spec, RealExecutorConfig(device="cuda", dtype="bf16", warmup=False))
    bs = 16
    blocks = batch * (-(-(ctx + 64) // bs))
    ex.init_kv_cache(blocks, 0, bs)
    kv = KVBlockManager(blocks, bs, 0)
    g = torch.Generator().manual_seed(0)
    for rid in range(batch):
        ex.add_request(rid, torch.randint(0, spec.vocab_size, (ctx,), generator=g).tolist())
        kv.allocate_slots(rid, ctx)
        # prefill one request per step: what the decode step reads must really be there
        ex.execute(StepPlan([ScheduledRequest(rid, 0, ctx, kv.block_table(rid), True)]))
    pos = {rid: ctx for rid in range(batch)}

    def step() -> float:
        plan = StepPlan()
        for rid in range(batch):
            kv.allocate_slots(rid, pos[rid] + 1)
            plan.scheduled.append(ScheduledRequest(rid, pos[rid], 1, kv.block_table(rid), True))
            pos[rid] += 1
        return ex.execute(plan).duration

    for _ in range(3):
        step()
    t = sorted(step() for _ in range(20))[10]
    floor = ex.weight_bytes() / copy_bw
    ex = None  # drop the weights (the closure's reference too) before emptying the cache
    torch.cuda.empty_cache()
    return t, floor, t / floor


def end_to_end(num_requests: int) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.simulation import Simulation
    from sim.specs import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=[
            "executor=real", "device=cuda", "model=llama3_8b", "executor.dtype=bf16",
            f"workload.num_requests={num_requests}", "progress=false"])
    cfg = OmegaConf.to_container(composed, resolve=True)
    cfg.pop("hydra", None)
    wall = time.perf_counter()
    s = Simulation(cfg).run().summary
    s["wall"] = time.perf_counter() - wall
    return s


def versions() -> list[tuple[str, str]]:
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (no nvidia-smi)"
    return [("device", torch.cuda.get_device_name()), ("driver", driver),
            ("CUDA (torch)", str(torch.version.cuda)), ("torch", torch.__version__),
            ("triton", triton.__version__), ("python", platform.python_version())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to measure", file=sys.stderr)
        return 1
    lines = ["| item | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in versions()]
    lines += ["", "| kernel (bf16) | max abs err vs torch reference | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in check_kernels()]
    bw = copy_bandwidth()
    attn_bw, frac = decode_bandwidth(bw)
    lines += ["", "| measurement | value | target |", "|---|---|---|",
              f"| device-to-device copy | {bw / 1e9:.0f} GB/s | |",
              f"| decode attention, batch 64 x ctx 4096 | {attn_bw / 1e9:.0f} GB/s = "
              f"{100 * frac:.0f}% of copy | >= 70% |"]
    for batch in (1, 64):
        t, floor, ratio = decode_step(bw, batch)
        target = "<= 1.3x" if batch == 1 else ""
        lines.append(f"| Llama-3-8B bf16 decode step, batch {batch}, ctx 1024 | {1e3 * t:.2f} ms "
                     f"= {ratio:.2f}x weight-read floor ({1e3 * floor:.2f} ms) | {target} |")
    s = end_to_end(args.requests)
    lines.append(f"| end to end: {s['completed']} of {args.requests} requests, Llama-3-8B "
                 f"bf16 | {s['output_throughput']:.0f} out tok/s, median TTFT "
                 f"{s['median_ttft_ms']:.0f} ms, median TPOT {s['median_tpot_ms']:.1f} ms, "
                 f"{s['wall']:.0f} s wall | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(f"# GPU validation\n\nOutput of `python -m experiments.gpu_check`.\n\n"
                            f"{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
