"""docs/outputs.md's lists of `requests.csv` / `steps.csv` columns and `summary.json` keys (and
docs/cluster.md's cluster keys) are exactly what runs write: users' scripts read these names,
so a column added or renamed without its documentation fails here."""

from __future__ import annotations

import csv
import itertools
import json
import re
from pathlib import Path

from experiments.simulation import Simulation
from tests.helpers import compose_cfg

ROOT = Path(__file__).resolve().parent.parent


def _documented_names(text: str) -> set[str]:
    """Every identifier-like name in backticks: comma-separated lists split, and patterns
    expanded (``mean/p99_{ttft,itl}_ms``: each alternative before the first ``_`` with each
    choice in braces; ``mean/p99_kv_time_ms``: each alternative with the rest)."""
    names: set[str] = set()
    # Code blocks would pair the backticks wrongly.
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
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
    """docs/outputs.md's section of the three files' lists, up to the next section."""
    page = (ROOT / "docs" / "outputs.md").read_text()
    start = page.index("## requests.csv, steps.csv and summary.json")
    return page[start:page.index("\n## ", start + 1)]


def _between(text: str, start: str, end: str) -> str:
    a = text.index(start)
    return text[a:text.index(end, a) + len(end)]


FILES = {"requests.csv", "steps.csv", "summary.json", "report.html"}
# Backticked words of the lists that are not output names: step_engine's values, named beside
# it, and vLLM's benchmark, whose keys these are.
NOT_NAMES = {"replica", "array_core", "benchmark_serving"}


def _run(tmp_path: Path, *overrides: str) -> set[str]:
    """Every summary.json key and requests.csv / steps.csv column a run writes."""
    Simulation(compose_cfg("workload.num_requests=20", *overrides), tmp_path).run()
    names = set(json.loads((tmp_path / "summary.json").read_text()))
    for f in ("requests.csv", "steps.csv"):
        names.update(next(csv.reader((tmp_path / f).open())))
    return names


def test_pattern_expansion() -> None:
    assert _documented_names("`mean/p99_{ttft,itl}_ms`, `a_b, c`, `mean/p99_kv_time_ms`") == {
        "mean_ttft_ms", "mean_itl_ms", "p99_ttft_ms", "p99_itl_ms", "a_b", "c",
        "mean_kv_time_ms", "p99_kv_time_ms"}


def test_outputs_md_lists_exactly_what_runs_write(tmp_path: Path) -> None:
    """Single replica: docs/outputs.md's lists without its cluster bullet. Co-located replicas:
    exactly that bullet's names more (the page says so; disaggregation is docs/cluster.md)."""
    section = _outputs_section()
    bullet = _between(section, "- cluster runs only", "`replicas` list")
    cluster = _documented_names(bullet) - FILES
    bars = _documented_names(_between(section, "- error bars (", "come from;")) - FILES
    single = _run(tmp_path / "one")
    assert _documented_names(section) - FILES - NOT_NAMES - cluster - (bars - single) == single
    assert _run(tmp_path / "two", "cluster.num_replicas=2") - single == cluster


def test_outputs_md_lists_exactly_the_error_bars_keys(tmp_path: Path) -> None:
    """What ``experiments.run`` adds to summary.json with error bars: docs/outputs.md's bullet."""
    from experiments.intervals import with_intervals

    bullet = _between(_outputs_section(), "- error bars (", "come from;")
    cfg = compose_cfg("workload.num_requests=20", "goodput={ttft_ms:500}")
    summary = Simulation(cfg, None).run().summary
    added = set(with_intervals(cfg, summary)) - set(summary)
    assert _documented_names(bullet) - FILES == added


def test_cluster_md_lists_exactly_what_disaggregated_runs_add(tmp_path: Path) -> None:
    paragraph = _between((ROOT / "docs" / "cluster.md").read_text(),
                         "Cluster runs (more than one replica", "`link_utilization_per_port`.")
    single = _run(tmp_path / "one")
    added = _run(tmp_path / "pd", "cluster=disaggregated") - single
    assert _documented_names(paragraph) - FILES == added
