"""The simulator against numbers real engines published (``conf/published.yaml``).

    python -m experiments.published
    python -m experiments.published 'experiment.rows=[blog:1,mlperf:1]' experiment.workers=1
    python -m experiments.published executor.per_seq_overhead_us=5   # a what-if on every row

Reads the tables in ``published_dir`` (default ``../shared/published``: the vLLM v0.6.0
blog's throughput and latency figures and NVIDIA's MLPerf Inference v4.1 Llama-2-70B Offline
results, with their setups in the folder's README) at run time, simulates each row's setup
(``row_setup``: model, GPUs, tensor parallelism, replicas, batch limits, dtypes, lengths and
request rate as the row and README state them, and the blog's vLLM server flags from
``experiment.blog``; rows with the same setup share one run) and prints published | simulated |
error per row and per table. Nothing is tuned to the rows: the executor section (but the keys
of a row's engine flags, set through ``experiment.blog`` and ``experiment.mlperf``), the seed
and the kv keys a row does not set are the composed config's (so a command-line executor value
is a what-if on every row). Writes into the Hydra run folder:
``published.csv`` (one row per published figure), ``published_tables.csv`` (per table: mean
absolute and signed mean error), ``published.md`` (both tables) and ``published.html``.
The request streams and the ShareGPT length model are in
``experiments/analysis/published_lengths.py``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import hydra
import plotly.graph_objects as go
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from plotly.subplots import make_subplots

from experiments.analysis.published_lengths import LengthsWorkload, build_workload
from experiments.common import markdown_table, merge, write_csv
from experiments.intervals import with_intervals
from experiments.simulation import BuiltIn
from policies.trtllm import CAPACITY_POLICIES
from sim.config_types import as_bool, as_int
from sim.errors import ConfigError, exit_on_config_error, refuse_unknown, require
from sim.progress import job_bar
from sim.report import write_page
from sim.simulation import Simulation
from sim.specs import ModelSpec
from sim.workload import Workload
from workloads.base import resolve_path

CONF = Path(__file__).resolve().parent.parent / "conf"
BLOG, MLPERF = "vllm_v060_blog", "mlperf_v41_llama2_70b_offline"
FILES = {BLOG: "vllm_v060_blog.csv", MLPERF: "mlperf_v41_llama2_70b_offline.csv"}
MLPERF_LENGTHS = "mlperf_llama2_lengths.csv"
BLOG_GPUS = {"H100": "h100_sxm", "A100": "a100_80gb"}  # the blog's H100-80GB SXM, A100-80GB
MLPERF_GPUS = {"H100-SXM-80GB": "h100_sxm", "H200-SXM-141GB": "h200"}
# MLPerf's figures and the summary.json keys that simulate them.
MLPERF_METRICS = {"tokens_per_s": "output_throughput", "samples_per_s": "request_throughput"}
BLOG_METRICS = ("request_throughput", "mean_tpot_ms", "mean_ttft_ms")
# Each source's engine (conf/engine/<name>.yaml: its policy and the defaults that differ).
ENGINES = {BLOG: "vllm_v0_6", MLPERF: "trtllm"}
# vLLM 0.6 without chunked prefill (off by default for these models' 8k contexts) batches
# max(max_model_len, 2048) tokens, a rule of the model the engine file cannot state.
VLLM_V06_MIN_BATCHED_TOKENS = 2048
@dataclass(frozen=True)
class Row:
    """One published figure: ``setup`` is its CSV line (strings), ``metric`` the
    ``summary.json`` key that simulates it."""

    id: str          # "blog:3", "mlperf:1" (the data line's number in its file)
    source: str      # BLOG or MLPERF
    table: str       # the blog's "throughput" / "latency"; MLPerf's "offline"
    setup: dict[str, str]
    metric: str
    published: float
    read_accuracy: str


@dataclass(frozen=True)
class RunSetup:
    """A row's run: its engine (``conf/engine/<name>.yaml``: a policy and values), config
    group choices (``conf/<group>/<name>.yaml``), values over them (``workload`` replaces the
    section outright), and what the run cannot model as stated."""

    engine: str
    groups: dict[str, str]
    values: dict[str, Any]
    note: str = ""
    label: str = field(default="", compare=False)


# ---- reading the tables ---------------------------------------------------------------------
def published_folder(path: str) -> Path:
    """The folder of the published tables, with every file this command reads."""
    try:
        folder = resolve_path(path, "published_dir")
    except ConfigError:
        raise ConfigError("published_dir", f"{path}: no such folder (it holds "
                          f"{', '.join([*FILES.values(), MLPERF_LENGTHS])}); set "
                          "published_dir=<folder>") from None
    for name in [*FILES.values(), MLPERF_LENGTHS]:
        require((folder / name).is_file(), "published_dir", f"{folder} has no {name}")
    return folder


def _read_csv(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = sorted(set(columns) - set(reader.fieldnames or ()))
        require(not missing, "published_dir", f"{path}: no column {missing[:1]}")
        return list(reader)


def _number(value: str, where: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError("published_dir", f"{where}: {value!r} is not a number") from None


def read_rows(folder: Path) -> list[Row]:
    """Every published figure of the two tables, in file order."""
    rows = []
    blog = folder / FILES[BLOG]
    cols = ("table", "model", "gpus", "dataset", "input_len", "output_len", "num_prompts",
            "request_rate", "metric", "value", "read_accuracy")
    for i, line in enumerate(_read_csv(blog, cols), start=1):
        where = f"{blog}:{i + 1}"
        require(line["metric"] in BLOG_METRICS, "published_dir",
                f"{where}: unknown metric {line['metric']!r}; known: {', '.join(BLOG_METRICS)}")
        rows.append(Row(f"blog:{i}", BLOG, line["table"], line, line["metric"],
                        _number(line["value"], where), line["read_accuracy"]))
    mlperf = folder / FILES[MLPERF]
    cols = ("system", "gpus", "replicas", "tensor_parallel", "max_batch", "weights",
            "kv_cache", *MLPERF_METRICS)
    for i, line in enumerate(_read_csv(mlperf, cols), start=1):
        for name, key in MLPERF_METRICS.items():
            rows.append(Row(f"mlperf:{i}", MLPERF, "offline", line, key,
                            _number(line[name], f"{mlperf}:{i + 1}"), "as submitted"))
    return rows


# ---- a row's setup --------------------------------------------------------------------------
def _group(group: str, name: str) -> dict[str, Any]:
    path = CONF / group / f"{name}.yaml"
    require(path.is_file(), group, f"no config conf/{group}/{name}.yaml")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def _int(value: str, what: str, row: Row) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError("published_dir", f"{row.id}: {what} {value!r} is not an "
                          "integer") from None


def row_setup(row: Row, exp: dict[str, Any], folder: Path) -> RunSetup:
    """The run that simulates ``row`` (``exp``: the config's ``experiment`` section)."""
    s = row.setup
    if row.source == BLOG:
        m = re.fullmatch(r"(\d+)x(\w+)", s["gpus"])
        require(m is not None and m.group(2) in BLOG_GPUS, "published_dir",
                f"{row.id}: gpus {s['gpus']!r}; known: <n>x{{{','.join(BLOG_GPUS)}}}")
        gpus, gpu = int(m.group(1)), m.group(2)  # type: ignore[union-attr]
        max_len = int(_group("model", s["model"])["max_model_len"])
        n = exp.get("num_prompts") or _int(s["num_prompts"], "num_prompts", row)
        workload: dict[str, Any] = {"name": "published", "dataset": s["dataset"],
                                    "num_prompts": int(n),
                                    "request_rate": _number(s["request_rate"], row.id)}
        if s["dataset"] == "fixed":
            workload["input_len"] = _int(s["input_len"], "input_len", row)
            workload["output_len"] = _int(s["output_len"], "output_len", row)
            note = ""
        elif s["dataset"] == "sharegpt":
            workload["sharegpt"] = dict(exp.get("sharegpt") or {})
            note = "ShareGPT length model (a fit, not the data set)"
        else:
            raise ConfigError("published_dir", f"{row.id}: unknown dataset {s['dataset']!r}")
        flags = blog_engine(exp)
        executor = {"num_scheduler_steps": flags["num_scheduler_steps"]}
        if flags["host_overlap"] is not None:
            executor["host_overlap"] = as_bool(flags["host_overlap"],
                                               "experiment.blog.host_overlap")
        return RunSetup(
            engine=ENGINES[BLOG],
            groups={"model": s["model"], "hardware": BLOG_GPUS[gpu], "cluster": "single"},
            values={"model": {"weight_dtype": "bf16", "kv_cache_dtype": "bf16"},
                    "policy": {"max_num_seqs": flags["max_num_seqs"],
                               "max_num_batched_tokens":
                               max(max_len, VLLM_V06_MIN_BATCHED_TOKENS)},
                    "executor": executor,
                    "cluster": {"tensor_parallel_size": gpus, "num_replicas": 1},
                    "workload": workload},
            note=note,
            label=" ".join([s["model"], s["gpus"], s["dataset"]]
                           + ([f"{s['input_len']}/{s['output_len']}"] if s["input_len"] else [])
                           + [f"rate {s['request_rate']}"]))
    system = s["system"].split("x", 1)
    require(len(system) == 2 and system[1] in MLPERF_GPUS, "published_dir",
            f"{row.id}: system {s['system']!r}; known: <n>x{{{','.join(MLPERF_GPUS)}}}")
    hardware = MLPERF_GPUS[system[1]]
    replicas, tp = (_int(s[k], k, row) for k in ("replicas", "tensor_parallel"))
    require(replicas * tp == _int(s["gpus"], "gpus", row), "published_dir",
            f"{row.id}: {replicas} replicas x TP{tp} is not {s['gpus']} GPUs")
    mp = _options(exp, "mlperf")
    outputs = mp["outputs"]
    require(outputs in ("scaled", "reference"), "experiment.mlperf.outputs",
            f"must be scaled or reference, got {outputs!r}")
    max_output = as_int(mp["max_output"], "experiment.mlperf.max_output", minimum=1)
    batched = as_int(mp["max_num_batched_tokens"], "experiment.mlperf.max_num_batched_tokens",
                     minimum=1)
    capacity = mp["capacity_scheduler_policy"]
    require(capacity in CAPACITY_POLICIES, "experiment.mlperf.capacity_scheduler_policy",
            f"must be one of {CAPACITY_POLICIES}, got {capacity!r}")
    per_sample = (_number(s["tokens_per_s"], row.id) / _number(s["samples_per_s"], row.id))
    workload = {"name": "published", "dataset": "mlperf",
                "path": str(folder / MLPERF_LENGTHS),
                "num_prompts": (_count_lines(folder) if exp.get("mlperf_samples") is None else
                                as_int(exp["mlperf_samples"], "experiment.mlperf_samples", 1)),
                "request_rate": math.inf,
                "output_mean": round(per_sample, 1) if outputs == "scaled" else None,
                "max_output": max_output}
    weights, kv_cache_dtype = s["weights"], s["kv_cache"]
    note = (f"outputs scaled to {per_sample:.1f} tokens/sample" if outputs == "scaled"
            else "reference output lengths")
    if weights == "fp8" and not float(_group("hardware", hardware).get("peak_tflops_fp8", 0)):
        note += f"; {hardware} has no FP8: GEMMs priced at its fp16 peak"
    return RunSetup(
        engine=ENGINES[MLPERF],
        groups={"model": "llama2_70b", "hardware": hardware, "cluster": "single"},
        values={"model": {"weight_dtype": weights, "kv_cache_dtype": kv_cache_dtype},
                "policy": {"max_num_seqs": _int(s["max_batch"], "max_batch", row),
                           "max_num_batched_tokens": batched,
                           "capacity_scheduler_policy": capacity},
                "executor": {"host_overlap": as_bool(mp["host_overlap"],
                                                     "experiment.mlperf.host_overlap")},
                "cluster": {"tensor_parallel_size": tp, "num_replicas": replicas},
                # engine=trtllm reuses KV blocks; NVIDIA's harness runs without block reuse.
                "kv": {"enable_prefix_caching": False}, "workload": workload},
        note=note,
        label=f"llama2_70b {s['system']} {replicas}xTP{tp} batch {s['max_batch']} {weights}")


def blog_engine(exp: dict[str, Any]) -> dict[str, Any]:
    """The blog rows' engine flags: ``experiment.blog`` over conf/published.yaml's."""
    return _options(exp, "blog")


@cache
def _published_defaults() -> dict[str, Any]:
    """conf/published.yaml's ``experiment`` section, read once."""
    section = OmegaConf.load(CONF / "published.yaml").experiment
    return OmegaConf.to_container(section)  # type: ignore[return-value]


def _options(exp: dict[str, Any], section: str) -> dict[str, Any]:
    """``experiment.<section>`` over conf/published.yaml's (the blog's server flags, the MLPerf
    rows' options: each key explained there); an unknown key is refused."""
    defaults = _published_defaults()[section]
    given = dict(exp.get(section) or {})
    refuse_unknown(given, defaults, f"experiment.{section}", "key")
    return {**defaults, **given}


def _count_lines(folder: Path) -> int:
    with (folder / MLPERF_LENGTHS).open() as fh:
        return sum(1 for _ in fh) - 1


def engine_file(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``conf/engine/<name>.yaml`` as the group choices its defaults list overrides and the
    values it sets."""
    data = _group("engine", name)
    groups = {}
    for entry in data.pop("defaults", None) or []:
        key, choice = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        require(str(key).startswith("override /") and isinstance(choice, str), "engine",
                f"conf/engine/{name}.yaml: a defaults entry must be 'override /<group>: "
                f"<name>', got {entry!r}")
        groups[str(key).removeprefix("override /")] = choice
    return groups, data


def run_config(base: dict[str, Any], setup: RunSetup) -> dict[str, Any]:
    """The full simulation config of ``setup`` over the composed ``base``: its engine's group
    choices and values, then the row's (the base's executor, kv, seed and engine switches are
    kept where neither sets them)."""
    cfg = {k: v for k, v in base.items() if k not in ("experiment", "published_dir")}
    engine_groups, engine_values = engine_file(setup.engine)
    for group, name in {**engine_groups, **setup.groups}.items():
        cfg[group] = _group(group, name)
    values = dict(setup.values)
    cfg["workload"] = dict(values.pop("workload"))
    return {**merge(merge(cfg, engine_values), values), "progress": False,
            "record_steps": False}


# ---- running --------------------------------------------------------------------------------
class PublishedComponents(BuiltIn):
    """The built-in components, plus the ``published`` workload (fixed lengths, the ShareGPT
    model or MLPerf's samples, sent at once or as a Poisson stream)."""

    def make_workload(self, section: dict[str, Any], seed: int, *, model: ModelSpec,
                      token_ids: bool) -> Workload:
        if section.get("name") == "published":
            require(not token_ids, "executor.name", "these runs give lengths, not token ids: "
                    "use a cost model executor")
            return build_workload(section, seed)
        return super().make_workload(section, seed, model=model, token_ids=token_ids)


COMPONENTS = PublishedComponents()
KEPT = ("completed", "rejected", "num_preemptions", "request_throughput", "output_throughput",
        "mean_ttft_ms", "mean_tpot_ms", "total_input_tokens", "total_output_tokens")


def simulate(cfg: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (``KEPT``), its simulated and wall seconds."""
    t0 = time.perf_counter()
    sim = Simulation(cfg, None, components=COMPONENTS)
    w = sim.workload
    summary = with_intervals(cfg, sim.run().summary, simulate=lambda c: Simulation(
        c, None, components=COMPONENTS).run().summary)
    out = {k: summary[k] for k in KEPT}
    out.update({f"{k}{end}": summary[f"{k}{end}"] for k in KEPT for end in ("_lo", "_hi")
                if f"{k}{end}" in summary})
    if isinstance(w, LengthsWorkload):  # what the lengths drawn came to
        out.update(mean_prompt_len=float(w.prompts.mean()),
                   mean_output_len=float(w.outputs.mean()), max_output_len=int(w.outputs.max()))
    out["simulated_s"] = summary["total_output_tokens"] / summary["output_throughput"]
    out["wall_s"] = time.perf_counter() - t0
    return out


def select(rows: list[Row], ids: Sequence[str] | None) -> list[Row]:
    if not ids:
        return rows
    if isinstance(ids, str):
        ids = [ids]
    known = list(dict.fromkeys(r.id for r in rows))
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ConfigError("experiment.rows", f"unknown row {unknown[0]!r}; known: "
                          f"{', '.join(known)}")
    return [r for r in rows if r.id in set(ids)]


def error_pct(simulated: float, published: float) -> float:
    """Signed error of the simulation, in percent of the published figure."""
    return 100.0 * (simulated - published) / published


def run_rows(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """Every selected row's published and simulated figure (one dict per row)."""
    exp = cfg.get("experiment") or {}
    folder = published_folder(str(cfg.get("published_dir") or "../shared/published"))
    rows = select(read_rows(folder), exp.get("rows"))
    setups = [row_setup(r, exp, folder) for r in rows]
    configs = [run_config(cfg, s) for s in setups]
    # Rows with the same setup (one blog run gives throughput, TPOT and TTFT) share a run.
    keys = [json.dumps(c, sort_keys=True, default=str) for c in configs]
    unique = list(dict.fromkeys(keys))
    first = {k: keys.index(k) for k in unique}
    for k in unique:  # every run is built (its config checked) before any runs
        Simulation(configs[first[k]], None, components=COMPONENTS)
    # The longest runs (MLPerf's thousands of samples) first, so that workers finish together.
    order = sorted(unique, key=lambda k: -configs[first[k]]["workload"]["num_prompts"])
    results: dict[str, dict[str, Any]] = {}
    workers = max(1, int(exp.get("workers", 1)))
    t0 = time.perf_counter()

    bar = job_bar(len(unique), as_bool(cfg.get("progress", True), "progress"), desc="runs")

    def done(k: str, res: dict[str, Any]) -> None:
        results[k] = res
        bar.update(1)
        log(f"[{len(results)}/{len(unique)}] {setups[first[k]].label}: "
            f"{res['wall_s']:.1f} s wall ({time.perf_counter() - t0:.0f} s in all)", flush=True)

    with bar:
        if workers == 1:
            for k in order:
                done(k, simulate(configs[first[k]]))
        else:
            with ProcessPoolExecutor(workers) as pool:
                futures = {pool.submit(simulate, configs[first[k]]): k for k in order}
                for f in as_completed(futures):
                    done(futures[f], f.result())
    out = []
    for row, setup, key in zip(rows, setups, keys):
        res = results[key]
        notes = [setup.note] if setup.note else []
        if row.setup.get("dataset") == "sharegpt":
            notes.append(f"sample means {res['mean_prompt_len']:.0f}/"
                         f"{res['mean_output_len']:.0f}, longest output "
                         f"{res['max_output_len']}")
        if res["num_preemptions"]:
            notes.append(f"{res['num_preemptions']} preemptions")
        if res["rejected"]:
            notes.append(f"{res['rejected']} rejected")
        out.append({"id": row.id, "source": row.source, "table": row.table,
                    "setup": setup.label, "metric": row.metric, "published": row.published,
                    "simulated": res[row.metric],
                    "error_pct": error_pct(res[row.metric], row.published),
                    # The simulator's 90% interval (error bars) and whether it holds the
                    # published figure; None without error bars.
                    "simulated_lo": res.get(f"{row.metric}_lo"),
                    "simulated_hi": res.get(f"{row.metric}_hi"),
                    "within_interval": (res[f"{row.metric}_lo"] <= row.published
                                        <= res[f"{row.metric}_hi"]
                                        if f"{row.metric}_lo" in res else None),
                    "read_accuracy": row.read_accuracy, "note": "; ".join(notes),
                    "completed": res["completed"], "num_preemptions": res["num_preemptions"],
                    "mean_prompt_len": res.get("mean_prompt_len"),
                    "mean_output_len": res.get("mean_output_len"),
                    "simulated_s": res["simulated_s"], "wall_s": res["wall_s"]})
    return out


def table_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (source, table) and over all rows: mean absolute and signed mean error, worst row."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["table"]), []).append(r)
    if len(groups) > 1:
        groups[("all", "all")] = rows
    out = []
    for (source, table), rs in groups.items():
        errs = [r["error_pct"] for r in rs]
        worst = max(rs, key=lambda r: abs(r["error_pct"]))
        held = [r["within_interval"] for r in rs if r.get("within_interval") is not None]
        out.append({"source": source, "table": table, "rows": len(rs),
                    "mean_abs_error_pct": sum(map(abs, errs)) / len(errs),
                    "signed_mean_error_pct": sum(errs) / len(errs),
                    "worst": f"{worst['id']} {worst['metric']} {worst['error_pct']:+.1f}%",
                    "within_interval": f"{sum(held)}/{len(held)}" if held else ""})
    return out


# ---- outputs --------------------------------------------------------------------------------
def _fmt(x: Any) -> Any:
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
    return x


def shown(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The printed columns: published | simulated | error % per row."""
    return [{"id": r["id"], "table": r["table"], "setup": r["setup"], "metric": r["metric"],
             "published": _fmt(r["published"]), "simulated": _fmt(r["simulated"]),
             "error %": f"{r['error_pct']:+.1f}",
             "90% interval": (f"[{_fmt(r['simulated_lo'])}, {_fmt(r['simulated_hi'])}]"
                              + ("" if r["within_interval"] else " misses")
                              if r.get("simulated_lo") is not None else ""),
             "note": r["note"]} for r in rows]


def shown_summary(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"source": s["source"], "table": s["table"], "rows": s["rows"],
             "mean abs error %": f"{s['mean_abs_error_pct']:.1f}",
             "signed mean %": f"{s['signed_mean_error_pct']:+.1f}", "worst": s["worst"],
             "published within 90% interval": s["within_interval"]}
            for s in summary]


def _accuracy(text: str) -> float:
    m = re.search(r"([\d.]+)\s*%", text)
    return float(m.group(1)) if m else 0.0


def figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Signed error per row (with the published figure's reading accuracy as a bar), and
    published against simulated per metric."""
    metrics = list(dict.fromkeys((r["source"], r["metric"]) for r in rows))
    fig = make_subplots(rows=1 + len(metrics), cols=1, subplot_titles=[
        "simulated vs published: error % (whiskers: how precisely the figure was read)",
        *(f"{src}: {metric}" for src, metric in metrics)],
        vertical_spacing=0.25 / (1 + len(metrics)))
    labels = [f"{r['id']} {r['metric']}" for r in rows]
    colors = {"throughput": "#1f77b4", "latency": "#ff7f0e", "offline": "#2ca02c"}
    fig.add_trace(go.Bar(x=labels, y=[r["error_pct"] for r in rows],
                         marker_color=[colors.get(r["table"], "#7f7f7f") for r in rows],
                         error_y={"type": "data", "array": [_accuracy(r["read_accuracy"])
                                                            for r in rows]},
                         hovertext=[f"{r['setup']}<br>{r['note']}" for r in rows],
                         showlegend=False), 1, 1)
    fig.update_yaxes(title_text="error %", row=1)
    for i, (src, metric) in enumerate(metrics, start=2):
        mine = [r for r in rows if (r["source"], r["metric"]) == (src, metric)]
        x = [f"{r['id']}: {r['setup']}" for r in mine]
        for name, color in (("published", "#7f7f7f"), ("simulated", "#d62728")):
            # The simulated bars carry their 90% interval (error bars) where there is one.
            bars = ({"type": "data", "symmetric": False,
                     "array": [r["simulated_hi"] - r["simulated"] for r in mine],
                     "arrayminus": [r["simulated"] - r["simulated_lo"] for r in mine]}
                    if name == "simulated" and all(r.get("simulated_lo") is not None
                                                   for r in mine) else None)
            fig.add_trace(go.Bar(x=x, y=[r[name] for r in mine], name=name, marker_color=color,
                                 error_y=bars, legendgroup=name, showlegend=i == 2), i, 1)
        fig.update_yaxes(title_text=metric, row=i)
    fig.update_layout(height=380 * (1 + len(metrics)), barmode="group",
                      title="Published serving measurements against the simulator")
    return fig


def write_outputs(out_dir: Path, rows: list[dict[str, Any]],
                  summary: list[dict[str, Any]], command: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "published.csv", rows)
    write_csv(out_dir / "published_tables.csv", summary)
    text = (f"Command: {command}\n\n{markdown_table(shown(rows))}\n\n"
            f"{markdown_table(shown_summary(summary))}\n")
    (out_dir / "published.md").write_text(text)
    pre = f"<p>{command}</p>{_html_table(shown_summary(summary))}{_html_table(shown(rows))}"
    write_page(out_dir / "published.html", "Published measurements vs simulated",
               [figure(rows)], pre)


def _html_table(rows: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{c}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in r.values()) + "</tr>"
                   for r in rows)
    return f"<table border='1' cellspacing='0' cellpadding='3'><tr>{head}</tr>{body}</table>"


def run_experiment(cfg: dict[str, Any], out_dir: Path | None, command: str = "",
                   log: Any = print) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every selected row; write the outputs into ``out_dir`` (None: nothing written)."""
    rows = run_rows(cfg, log)
    summary = table_summary(rows)
    if out_dir is not None:
        write_outputs(out_dir, rows, summary, command or "python -m experiments.published")
    return rows, summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="published")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)  # type: ignore[union-attr]
    command = " ".join(["python -m experiments.published", *HydraConfig.get().overrides.task])
    t0 = time.perf_counter()
    with exit_on_config_error():
        engine = HydraConfig.get().runtime.choices.get("engine")
        require(engine in (None, "none"), "engine", (
            f"each published row runs its source's engine ({', '.join(ENGINES.values())}), "
            f"got engine={engine}; the rows' engine flags are experiment.blog.* and "
            f"experiment.mlperf.*"))
        rows, summary = run_experiment(container, out, command)  # type: ignore[arg-type]
    print(markdown_table(shown(rows)))
    print()
    print(markdown_table(shown_summary(summary)))
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s; outputs: {out}")


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
