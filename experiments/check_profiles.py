"""Check the cost model against Vidur's measured A100/H100 operator profiles.

    python -m experiments.check_profiles                          # ../shared/profiles/vidur
    python -m experiments.check_profiles profiles_dir=/path/to/vidur
    python -m experiments.check_profiles detail=true   # per layer, measured vs cost model

For Llama-2-7B on A100 and H100 and Llama-3-8B on A100 it compares the per-layer linear time
(the four projections: attn_pre_proj + attn_post_proj + mlp_up_proj + mlp_down_proj, TP 1,
num_tokens 1..4096) with the cost model's ``linear`` term; for the A100 attention file
(Llama-2-70B at TP 2) it compares ``attn_decode`` and ``attn_prefill`` with the attention terms.
Each check prints the MAPE of the uncalibrated roofline (spec defaults, nothing fitted) and of
the calibrated model fitted on half the rows (shapes sorted, every other one) and tested on the
other half. The last line is ``profiles MAPE: roofline X% calibrated Y%``: the mean over the
five checks. Element-wise operators (norms, RoPE, activation, add) and attention's reshape
copies are priced by other terms and are not part of these sums (docs/calibration.md).
``detail=true`` adds, for every ``*_mlp.csv`` profile at its lowest TP degree, one layer's
measured linear and element-wise time at a few token counts beside the cost model's ``linear``
and ``elementwise`` terms (spec defaults).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executors.calibration import ShapeSpec, fit_coefficients, mape, predict
from executors.cost_model import CostModelConfig, RooflineCostModel
from executors.step_terms import StepDecomposer, StepShape
from executors.uncertainty import LEVEL, ratio_interval
from sim.errors import ConfigError, apply_cli_overrides
from sim.specs import ModelSpec, load_hardware_spec
from workloads.base import resolve_path

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# Vidur's element-wise operators of a layer (the cost model's ``elementwise`` term).
ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
DETAIL_TOKENS = (1, 8, 64, 512, 2048, 4096)
HARDWARE = {"a100": "a100_80gb", "h100": "h100_sxm"}  # the profile files' GPU prefixes
LINEAR_FILES = (  # (label, file, hardware conf)
    ("Llama-2-7B A100", "compute/a100_Llama-2-7b-hf_mlp.csv", "a100_80gb"),
    ("Llama-2-7B H100", "compute/h100_Llama-2-7b-hf_mlp.csv", "h100_sxm"),
    ("Llama-3-8B A100", "compute/a100_Meta-Llama-3-8B_mlp.csv", "a100_80gb"),
)
ATTENTION_FILE = "compute/a100_Llama-2-70b-hf_tp2_attention.csv"
MAX_TOKENS = 4096
# Coefficients each check may fit: the terms that price that operator (and its fixed cost).
LINEAR_TERMS = ("s_per_step", "s_per_token", "s_per_flop", "s_per_weight_byte")
DECODE_TERMS = ("s_per_seq", "s_per_attn_flop", "s_per_kv_byte", "s_per_cta_byte",
                "s_per_sm_byte", "s_per_attn_wave", "s_per_attn_kernel", "s_per_split_partial",
                "s_per_kv_tile")
PREFILL_TERMS = ("s_per_token", "s_per_attn_flop", "s_per_diag_flop", "s_per_kv_byte",
                 "s_per_attn_kernel")


@dataclass
class CheckResult:
    name: str
    rows: int
    roofline_mape: float  # percent, all rows
    calibrated_mape: float  # percent, held-out rows
    sharpness: float
    roofline_ratios: np.ndarray  # measured / roofline time, per row


def _geometry(name: str, n_embd: int, n_head: int, n_kv_head: int, n_expanded: int,
              vocab: int) -> ModelSpec:
    """One layer of the profiled model (layers do not matter per layer)."""
    return ModelSpec(name=name, num_layers=1, hidden_size=n_embd, num_heads=n_head,
                     num_kv_heads=n_kv_head, head_dim=n_embd // n_head,
                     intermediate_size=n_expanded, vocab_size=vocab, max_model_len=MAX_TOKENS)


def _read(path: Path):
    import pandas as pd

    if not path.exists():
        raise ConfigError("profiles_dir", f"missing profile file {path}")
    return pd.read_csv(path)


def _check(name: str, shapes: Sequence[StepShape], y: np.ndarray, roofline: np.ndarray,
           decomposer: StepDecomposer, terms: Sequence[str]) -> CheckResult:
    """Roofline MAPE on every row; calibrated MAPE fitted on even rows, tested on odd ones."""
    drivers = [decomposer.drivers(s) for s in shapes]
    fit_i, test_i = np.arange(0, len(y), 2), np.arange(1, len(y), 2)
    f = fit_coefficients([drivers[i] for i in fit_i], y[fit_i], active=terms)
    pred = predict(f.coefficients, drivers)
    return CheckResult(name, len(y), mape(roofline, y), mape(pred[test_i], y[test_i]),
                       f.coefficients.sharpness, y / roofline)


def check_linear(root: Path, label: str, file: str, hardware: str) -> CheckResult:
    df = _read(root / file)
    df = df[(df.num_tensor_parallel_workers == 1) & (df.num_tokens <= MAX_TOKENS)]
    if df.empty:
        raise ConfigError("profiles_dir", f"{root / file}: no TP 1 rows with num_tokens <= 4096")
    r = df.iloc[0]
    model = _geometry(label, int(r.n_embd), int(r.n_head), int(r.n_kv_head),
                      int(r.n_expanded_embd), int(r.vocab_size))
    total = df[[f"time_stats.{op}.median" for op in LINEAR_OPS]].sum(axis=1)
    y_ms = total.groupby(df.num_tokens).median()  # repeated shapes: one row each
    n_tokens = [int(n) for n in y_ms.index]
    cm = RooflineCostModel(model, load_hardware_spec(hardware))
    # One row with num_tokens query tokens, no sampling: exactly the layer's projections.
    shapes = [ShapeSpec("prefill", num_prefill_seqs=1, prefill_chunk=n, num_sampled=0).shape()
              for n in n_tokens]
    roof = np.array([cm.breakdown_shape(s).linear for s in shapes])
    return _check(f"linear {label}", shapes, y_ms.to_numpy() * 1e-3, roof, cm.decomposer,
                  LINEAR_TERMS)


def check_attention(root: Path) -> list[CheckResult]:
    df = _read(root / ATTENTION_FILE)
    r = df.iloc[0]
    tp = int(r.num_tensor_parallel_workers)
    model = _geometry("Llama-2-70B", int(r.n_embd), int(r.n_q_head), int(r.n_kv_head), 28672,
                      32000)
    # The profiled kernel: FlashAttention's split-KV heuristic over block tables as wide as
    # the profile's max_model_len (its split counts follow from 4096 tokens at every context).
    cfg = CostModelConfig(attention_split_rule="flash",
                          attention_split_kv_len=int(r.max_model_len))
    cm = RooflineCostModel(model, load_hardware_spec("a100_80gb"), tp, cfg,
                           block_size=int(r.block_size))
    out = []
    dec = df[~df.is_prefill].groupby(["batch_size", "kv_cache_size"])[
        "time_stats.attn_decode.median"].median()
    shapes = [ShapeSpec("decode", num_decode_seqs=int(b), decode_context=int(k)).shape()
              for b, k in dec.index]
    roof = np.array([cm.breakdown_shape(s).attention_decode for s in shapes])
    out.append(_check("attention decode A100", shapes, dec.to_numpy() * 1e-3, roof,
                      cm.decomposer, DECODE_TERMS))
    pre = df[df.is_prefill].groupby(["prefill_chunk_size", "kv_cache_size"])[
        "time_stats.attn_prefill.median"].median()
    shapes = [ShapeSpec("prefill", num_prefill_seqs=1, prefill_chunk=int(c),
                        prefill_cached=int(k)).shape() for c, k in pre.index]
    roof = np.array([cm.breakdown_shape(s).attention_prefill for s in shapes])
    out.append(_check("attention prefill A100", shapes, pre.to_numpy() * 1e-3, roof,
                      cm.decomposer, PREFILL_TERMS))
    return out


def layer_detail(root: Path) -> list[str]:
    """Per ``*_mlp.csv`` profile (lowest TP degree): one layer's measured linear and
    element-wise medians against the cost model's terms at ``DETAIL_TOKENS``."""
    lines = [(f"{'profile':<34} {'tokens':>6} {'linear us':>10} {'model':>8} {'ratio':>6} "
              f"{'elementwise us':>15} {'model':>7}")]
    for path in sorted((root / "compute").glob("*_mlp.csv")):
        gpu = path.name.split("_", 1)[0]
        if gpu not in HARDWARE:
            continue
        df = _read(path)
        df = df[df.num_tensor_parallel_workers == df.num_tensor_parallel_workers.min()]
        r = df.iloc[0]
        tp = int(r.num_tensor_parallel_workers)
        model = _geometry(path.stem, int(r.n_embd), int(r.n_head), int(r.n_kv_head),
                          int(r.n_expanded_embd), int(r.vocab_size))
        cm = RooflineCostModel(model, load_hardware_spec(HARDWARE[gpu]), tp)
        lin = df[[f"time_stats.{op}.median" for op in LINEAR_OPS]].sum(axis=1).groupby(
            df.num_tokens).median()
        ew = df[[f"time_stats.{op}.median" for op in ELEMENTWISE_OPS]].sum(axis=1).groupby(
            df.num_tokens).median()
        for n in DETAIL_TOKENS:
            if n not in lin.index:
                continue
            b = cm.breakdown_shape(ShapeSpec("prefill", num_prefill_seqs=1, prefill_chunk=n,
                                             num_sampled=0).shape())
            lines.append(f"{path.stem + f' tp{tp}':<34} {n:>6} {lin[n] * 1e3:>10.1f} "
                         f"{b.linear * 1e6:>8.1f} {lin[n] * 1e-3 / b.linear:>6.2f} "
                         f"{ew[n] * 1e3:>15.1f} {b.elementwise * 1e6:>7.1f}")
    return lines


def check_profiles(profiles_dir: str | Path) -> list[CheckResult]:
    """Every check, in print order."""
    root = resolve_path(str(profiles_dir), "profiles_dir")
    results = [check_linear(root, *spec) for spec in LINEAR_FILES]
    return results + check_attention(root)


def format_results(results: Sequence[CheckResult]) -> list[str]:
    lines = [f"{'check':<26} {'rows':>5} {'roofline':>9} {'calibrated':>11}  knee p"]
    for c in results:
        p = "max" if math.isinf(c.sharpness) else f"{c.sharpness:g}"
        lines.append(f"{c.name:<26} {c.rows:>5} {c.roofline_mape:>8.1f}% "
                     f"{c.calibrated_mape:>10.1f}%  {p}")
    worst_r = max(c.roofline_mape for c in results)
    worst_c = max(c.calibrated_mape for c in results)
    lines.append(f"worst check: roofline {worst_r:.1f}% calibrated {worst_c:.1f}%")
    mean_r = float(np.mean([c.roofline_mape for c in results]))
    mean_c = float(np.mean([c.calibrated_mape for c in results]))
    lines.append(f"profiles MAPE: roofline {mean_r:.1f}% calibrated {mean_c:.1f}%")
    # The spread error_bars.roofline_step_time states (each check weighs the same).
    lo, hi = ratio_interval(np.concatenate([c.roofline_ratios for c in results]),
                            weights=np.concatenate([np.full(c.rows, 1.0 / c.rows)
                                                    for c in results]))
    lines.append(f"roofline {LEVEL:.0%} interval of measured / predicted time: "
                 f"[{lo:.3f}, {hi:.3f}]")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``key=value`` overrides: ``profiles_dir`` and ``detail`` (true | false)."""
    cfg = {"profiles_dir": "../shared/profiles/vidur", "detail": "false"}
    if not apply_cli_overrides(sys.argv[1:] if argv is None else argv, cfg,
                               "profiles_dir=<folder>, detail=true|false"):
        return 2
    try:
        if cfg["detail"] not in ("true", "false"):
            raise ConfigError("detail", f"must be true or false, got {cfg['detail']!r}")
        results = check_profiles(cfg["profiles_dir"])
        detail = (layer_detail(resolve_path(cfg["profiles_dir"], "profiles_dir"))
                  if cfg["detail"] == "true" else [])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_results(results)))
    if detail:
        print()
        print("\n".join(detail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
