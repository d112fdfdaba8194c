"""The README's lists of `requests.csv` / `steps.csv` columns and `summary.json` keys (and
docs/cluster.md's cluster keys) are exactly what runs write: users' scripts read these names,
so a column added or renamed without its documentation fails here."""

from __future__ import annotations

import csv
import itertools
import json
import re
from pathlib import Path

import pytest

from sim.simulation import Simulation
from tests.helpers import compose_cfg

ROOT = Path(__file__).resolve().parent.parent


def _documented_names(text: str) -> set[str]:
    """Every identifier-like name in backticks: comma-separated lists split, and patterns
    expanded (``mean/p99_{ttft,itl}_ms``: each alternative before the first ``_`` with each
    choice in braces; ``mean/p99_kv_time_ms``: each alternative with the rest)."""
    names: set[str] = set()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks would pair backticks wrongly
    for span in re.findall(r"`([^`]+)`", text):
        for item in (s.replace(" ", "").strip() for s in re.split(r",(?![^{]*\})", span)):
            if not re.fullmatch(r"[a-z0-9_/{},]+", item) or item.endswith("/"):  # not paths
                continue
            if "{" in item:  # ``mean/std/median_{ttft,itl}_ms``
                alts, _, rest = item.partition("_")
                stems = re.split(r"(\{[^}]*\})", rest)
                choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in stems]
                for a in alts.split("/"):
                    names.update(f"{a}_" + "".join(c) for c in itertools.product(*choices))
            elif "/" in item:
                alts, _, rest = item.partition("_")
                names.update(f"{a}_{rest}" for a in alts.split("/"))
            else:
                names.add(item)
    return names


def _outputs_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### Outputs")
    return readme[start:readme.index("\n## ", start)]


def _run(tmp_path: Path, *overrides: str) -> tuple[set[str], list[str], list[str]]:
    Simulation(compose_cfg("workload.num_requests=20", *overrides), tmp_path).run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    heads = [next(csv.reader((tmp_path / f).open())) for f in ("requests.csv", "steps.csv")]
    return set(summary), heads[0], heads[1]


def test_pattern_expansion() -> None:
    assert _documented_names("`mean/p99_{ttft,itl}_ms`, `a_b, c`, `mean/p99_kv_time_ms`") == {
        "mean_ttft_ms", "mean_itl_ms", "p99_ttft_ms", "p99_itl_ms", "a_b", "c",
        "mean_kv_time_ms", "p99_kv_time_ms"}


def test_single_replica_outputs_are_exactly_the_readme_lists(tmp_path: Path) -> None:
    documented = _documented_names(_outputs_section())
    keys, request_cols, step_cols = _run(tmp_path)
    for name, written in (("summary.json", keys), ("requests.csv", set(request_cols)),
                          ("steps.csv", set(step_cols))):
        assert written <= documented, f"{name} writes undocumented {sorted(written - documented)}"
    cluster_only = {"prefill_replica_id", "decode_replica_id", "kv_transfer_bytes",
                    "kv_backpressure_wait", "kv_transfer_time", "cluster", "num_replicas",
                    "num_gpus", "router", "pipeline_parallel", "replicas"}
    written = keys | set(request_cols) | set(step_cols) | cluster_only
    files = {"requests.csv", "steps.csv", "summary.json", "report.html"}
    values = {"replica", "array_core"}  # step_engine's values, named beside it
    values.add("benchmark_serving")  # vLLM's benchmark, whose keys these are
    missing = documented - written - files - values
    assert not missing, sorted(missing)


@pytest.mark.parametrize("overrides", [("cluster.num_replicas=2",), ("cluster=disaggregated",)],
                         ids=["replicas", "disaggregated"])
def test_cluster_outputs_are_documented(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    documented = (_documented_names(_outputs_section())
                  | _documented_names((ROOT / "docs" / "cluster.md").read_text()))
    keys, request_cols, step_cols = _run(tmp_path, *overrides)
    undocumented = (keys | set(request_cols) | set(step_cols)) - documented
    assert not undocumented, sorted(undocumented)
