"""Where a refitted profile misprices steps, by kind, on a saved validation's own real runs.

Refits a validation folder's profile (its ``profile.csv`` rows plus the serving steps of its
odd-numbered real runs, from ``replay_steps.csv``, as ``experiments/validate.py`` refits with
its calibration runs: the folder's ``validate.fit_statistic`` and ``calibration_level``) and
prices the even-numbered runs' steps, which the fit never saw. For
each fit it prints the summed predicted / measured time of the held-out steps by kind (decode
steps by rows, steps with a prompt), the per-run median of that ratio over all steps (``busy``)
and with each step weighted by its decode rows (the step time as the decoding requests see
it, what TPOT follows; ``rows-busy`` is how much dearer the model prices the steps many
requests share than the run as a whole), and the per-step MAPE. Each folder is
fitted twice: without the first-requests price (``seq_knee`` 0) and with the knee the fit
chooses (docs/calibration.md, "A price for a step's first requests").

    python -m experiments.refit_split outputs/validate/policies/0 outputs/validate/preempt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from executors.recording import serving_rows
from experiments.common import validation_files
from sim.errors import ConfigError, exit_on_config_error

DECODE_BANDS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 1 << 30))


def saved_validation_files(folder: Path, with_config: bool = True) -> list[Path]:
    """The files of a saved validation this module reads (profile, real steps, fitted
    profile, then its config when ``with_config``); a config error names the first missing."""
    names = ["profile.csv", "replay_steps.csv", "hardware_profile.yaml"]
    if with_config:
        names.append(".hydra/config.yaml")
    return validation_files(folder, names, "a saved validation")


def load_folder(folder: Path, cfg: dict | None = None,
                ) -> tuple[dict, list[dict], pd.DataFrame, object]:
    """(config, profile rows, serving steps of the real runs, rows-only profile); the config
    is the folder's ``.hydra/config.yaml`` unless given."""
    from executors.calibration import load_profile, read_profile_csv

    need = saved_validation_files(folder, with_config=cfg is None)
    if cfg is None:
        cfg = yaml.safe_load(need[3].read_text())
    steps = serving_rows(pd.read_csv(need[1])).reset_index(drop=True)
    if steps.run.nunique() < 2:
        raise ConfigError("folder", f"{folder}: replay_steps.csv has {steps.run.nunique()} "
                          "real run(s); the split needs two or more")
    return cfg, read_profile_csv(need[0]), steps, load_profile(need[2])


def split_errors(folder: Path, seq_knee: int | None, cfg: dict | None = None,
                 ) -> dict[str, object]:
    """Refit on the odd-numbered runs, price the even-numbered ones (module docstring);
    ``seq_knee`` as ``calibrate``'s (None: the fit chooses)."""
    from executors.calibration import calibrate, predict
    from executors.step_terms import StepDecomposer, StepShape
    from sim.specs import model_spec_from

    cfg, rows, steps, given = load_folder(folder, cfg)
    model = model_spec_from(dict(cfg["model"]), f"{folder}/.hydra/config.yaml model")
    tp = int(cfg.get("cluster", {}).get("tensor_parallel_size", 1))
    block = int(cfg["kv"]["block_size"])
    geometry = given.decomposition()  # as the cost model will decompose steps
    names = list(StepShape._fields)
    shapes = [StepShape(**{k: int(v) for k, v in zip(names, r)})
              for r in steps[names].itertuples(index=False)]
    y = steps.measured_s.to_numpy()
    fit_mask = (steps.run.to_numpy() % 2) == 1
    fitted = np.flatnonzero(fit_mask)
    opts = cfg.get("validate") or {}
    prof = calibrate(rows, model, tp, block, steps=[(shapes[i], y[i]) for i in fitted],
                     sharpness=given.coefficients.sharpness, seq_knee=seq_knee,
                     statistic=f"{opts.get('fit_statistic', 'median')}_s",
                     step_runs=steps.run.to_numpy()[fitted].tolist(),
                     run_level=str(opts.get("calibration_level", "mean")),
                     num_sms=given.fit.get("num_sms"), **geometry)
    dec = StepDecomposer(model, tp, block, given.fit.get("num_sms"), **geometry)
    held = np.flatnonzero(~fit_mask)
    pred = predict(prof.coefficients, [dec.drivers(shapes[i]) for i in held])
    t = steps.iloc[held].assign(pred=pred)
    by_run = t.groupby("run")
    busy = by_run.pred.sum() / by_run.measured_s.sum() - 1
    w = t.num_decode  # what each decoding request waits for, once per step it is in
    rows_weighted = ((t.pred * w).groupby(t.run).sum()
                     / (t.measured_s * w).groupby(t.run).sum() - 1)
    out: dict[str, object] = {
        "seq_knee": prof.coefficients.seq_knee, "busy_pct": 100 * busy.median(),
        "rows_minus_busy_pct": 100 * (rows_weighted - busy).median(),
        "mape_pct": 100 * float(np.mean(np.abs(t.pred / t.measured_s - 1)))}
    decode = t[t.num_prefill == 0]
    for lo, hi in DECODE_BANDS:
        band = decode[(decode.num_decode >= lo) & (decode.num_decode <= hi)]
        key = f"decode_{lo}" if lo == hi else f"decode_{lo}_{hi if hi < 1 << 30 else 'up'}"
        out[key] = (100 * (band.pred.sum() / band.measured_s.sum() - 1)) if len(band) else None
    prompt = t[t.num_prefill > 0]
    out["with_prompt"] = (100 * (prompt.pred.sum() / prompt.measured_s.sum() - 1)
                          if len(prompt) else None)
    return out


def _label(folder: Path) -> str:
    doc = folder / "validation.json"
    policy = json.loads(doc.read_text()).get("policy", "") if doc.is_file() else ""
    where = "/".join(folder.parts[-3:])
    return f"{where} {policy}".strip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="validation output folders")
    args = ap.parse_args(argv)
    with exit_on_config_error():  # every folder checked before the table starts
        for folder in args.folders:
            saved_validation_files(folder)
        results = [(folder, split_errors(folder, knee)) for folder in args.folders
                   for knee in (0, None)]
    cols = ["decode_1", "decode_2_4", "decode_5_8", "decode_9_16", "decode_17_up", "with_prompt"]
    head = (f"{'folder':<36} {'knee':>4} {'busy%':>6} {'rows-busy':>9} "
            + " ".join(f"{c.replace('decode_', 'd'):>8}" for c in cols) + f" {'MAPE%':>6}")
    print("errors of summed held-out step time, % (decode steps by rows; steps with a prompt)")
    print(head)
    print("-" * len(head))
    for folder, r in results:
        cells = " ".join("       -" if r[c] is None else f"{r[c]:>+8.1f}" for c in cols)
        print(f"{_label(folder):<36} {r['seq_knee']:>4} {r['busy_pct']:>+6.2f} "
              f"{r['rows_minus_busy_pct']:>+9.2f} {cells} {r['mape_pct']:>6.2f}")


if __name__ == "__main__":
    main()
