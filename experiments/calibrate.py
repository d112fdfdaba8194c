"""Fit the cost model to a profile CSV and save the hardware profile.

    python -m experiments.calibrate profile_csv=outputs/profile/.../profile.csv
    python -m experiments.calibrate profile_csv=p.csv out=outputs/tiny_cpu.yaml
    python -m experiments.run executor.profile=outputs/tiny_cpu.yaml model=tiny ...

Half the shapes (every other one of each kind, sorted) are held out of the fit; the last line
is ``calibrated step-time MAPE: fit X% held-out Y%``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from executors.calibration import calibrate, read_profile_csv, save_profile
from executors.step_terms import ATTENTION_TILE
from sim.errors import ConfigError, apply_cli_overrides
from sim.memory import check_block_size
from sim.specs import CONF_DIR, load_hardware_spec, load_model_spec
from workloads.base import resolve_path


def _num_sms(value: str, rows: list[dict]) -> int | None:
    """The SM count the fit decomposes decode attention with (``StepDecomposer``)."""
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ConfigError("num_sms", f"must be an integer, got {value!r}") from None
        if n < 1:
            raise ConfigError("num_sms", f"must be >= 1, got {n}")
        return n
    device = str(rows[0].get("device", ""))
    if (CONF_DIR / "hardware" / f"{device}.yaml").exists():
        return load_hardware_spec(device).num_sms
    return None


def _attention_tile(value: str, rows: list[dict]) -> int:
    """The query tile the fit prices prefill attention in (``StepDecomposer``)."""
    if value:
        try:
            return int(value)
        except ValueError:
            raise ConfigError("attention_tile", f"must be an integer, got {value!r}") from None
    recorded = rows[0].get("attention_tile")
    if recorded is not None and recorded == recorded:  # NaN: a CSV without the column
        return int(recorded)
    return 1 if str(rows[0].get("device", "")) == "cpu" else ATTENTION_TILE


def main(argv: Sequence[str] | None = None) -> int:
    """``key=value`` overrides: ``profile_csv`` (required), ``out``, ``block_size``,
    ``num_sms`` (default: the hardware config named by the rows' ``device``, else none),
    ``attention_tile`` (default: the rows' ``attention_tile`` column, which the profiler
    records; CSVs without it: 1 for rows measured on ``device`` cpu, whose torch attention is
    untiled, else ``ATTENTION_TILE``)."""
    cfg = {"profile_csv": "", "out": "", "block_size": "16", "num_sms": "", "attention_tile": ""}
    if not apply_cli_overrides(sys.argv[1:] if argv is None else argv, cfg, ", ".join(cfg)):
        return 2
    try:
        if not cfg["profile_csv"]:
            raise ConfigError("profile_csv", "required: the CSV experiments/profile.py wrote")
        csv = resolve_path(cfg["profile_csv"], "profile_csv")
        rows = read_profile_csv(csv)
        names = {str(r.get("model")) for r in rows}
        tps = {int(r.get("tensor_parallel", 1)) for r in rows}
        if len(names) != 1 or len(tps) != 1:
            raise ConfigError("profile.model", f"{csv} mixes models {sorted(names)} or "
                              f"tensor_parallel {sorted(tps)}; fit one at a time")
        model = load_model_spec(names.pop())
        try:
            block_size = int(cfg["block_size"])
        except ValueError:
            raise ConfigError("block_size", f"must be an integer, got "
                                            f"{cfg['block_size']!r}") from None
        check_block_size(block_size, "block_size")
        prof = calibrate(rows, model, tps.pop(), block_size, source=str(csv),
                         num_sms=_num_sms(cfg["num_sms"], rows),
                         attention_tile=_attention_tile(cfg["attention_tile"], rows))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out = Path(cfg["out"]) if cfg["out"] else csv.with_name("hardware_profile.yaml")
    save_profile(prof, out)
    for name, value in prof.coefficients.as_dict().items():
        print(f"{name:<18} {value:.4g}")
    print(f"profile: {out}")
    f = prof.fit
    print(f"calibrated step-time MAPE: fit {f['mape_fit_pct']:.2f}% "
          f"held-out {f['mape_heldout_pct']:.2f}% ({f['rows_heldout']} held-out shapes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
