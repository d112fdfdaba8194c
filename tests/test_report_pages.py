"""The HTML pages runs write (report.html, policies.html): the figures' readability rules, the
shared plotly.min.js, the report.plotly_js option, and each page loaded in headless Chromium
(no console errors, every figure drawn, nothing fetched from the network)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.compare_policies import run as compare_policies
from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.report import (
    PLOTLY_JS_FILE,
    format_number,
    latency_cdf_figure,
    prefix_cache_figure,
    timeline_figure,
    write_report,
)
from sim.report_options import ReportOptions
from tests.helpers import ROOT, compose_cfg, compose_named

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SMALL = ("model=tiny", "workload.num_requests=60", "workload.shared_prefix_len=64",
         "kv.enable_prefix_caching=true")


def _report(out: Path, *overrides: str, options: ReportOptions | None = None,
            shared: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    res = Simulation(compose_cfg(*SMALL, *overrides), out).run()
    return write_report(out, res.summary, options, shared)


def _axes(fig) -> list:
    layout = fig.layout
    return [layout[k] for k in layout if re.fullmatch(r"[xy]axis\d*", k)]


def _steps(n: int = 400) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    prefill = np.where(rng.random(n) < 0.05, 7000, 0)
    return pd.DataFrame({"time": np.arange(n) * 0.05, "duration": np.full(n, 0.05),
                         "sampled": rng.integers(10, 60, n), "prefill_tokens": prefill,
                         "decode_tokens": rng.integers(10, 60, n),
                         "num_waiting": rng.integers(0, 3, n),
                         "num_running": rng.integers(20, 60, n), "num_swapped": np.zeros(n),
                         "kv_usage": rng.random(n)})


# The figures ------------------------------------------------------------------------------

def test_every_timeline_panel_has_its_own_legend_scale_and_units():
    fig = timeline_figure(_steps())
    by_name = {t.name.split(" (")[0]: t for t in fig.data}
    # prefill and decode tokens on axes of their own; waiting apart from running
    assert by_name["prefill tokens/step"].yaxis != by_name["decode tokens/step"].yaxis
    assert by_name["waiting"].yaxis != by_name["running"].yaxis
    assert by_name["waiting"].yaxis == by_name["swapped out"].yaxis
    assert not any(t.stackgroup for t in fig.data)  # nothing stacked on top of another
    # a legend per panel, beside it: each trace's legend sits at its own axis' top
    legends = {t.legend or "legend" for t in fig.data}
    axes = {t.yaxis for t in fig.data}
    assert len(legends) == len(axes) == 6
    for t in fig.data:
        legend = fig.layout[t.legend or "legend"]
        domain = fig.layout[t.yaxis.replace("y", "yaxis")].domain
        assert legend.y == pytest.approx(domain[1]) and legend.x > 1
        assert {u.legend or "legend" for u in fig.data if u.yaxis == t.yaxis} == {
            t.legend or "legend"}
    # every axis titled (with its unit)
    for axis in _axes(fig):
        assert axis.title.text, axis
    assert by_name["swapped out"].name == "swapped out (0 throughout)"


def test_no_axis_uses_exponents_or_si_suffixes():
    frames = {"a": pd.DataFrame({"status": ["finished"] * 3, "ttft": [0.1, 2e4, 3.0],
                                 "tpot": [0.01, 0.02, 0.03], "e2e_latency": [1, 2e5, 3]})}
    requests = pd.DataFrame({"status": ["finished"] * 2, "first_scheduled_time": [0.0, 1.0],
                             "num_cached_tokens": [0, 32], "prompt_len": [64, 64]})
    for fig in (timeline_figure(_steps()), latency_cdf_figure(frames),
                prefix_cache_figure(requests)):
        for axis in _axes(fig):
            assert axis.exponentformat == "none" and axis.separatethousands, axis
            assert "e" not in (axis.tickformat or "") and "s" not in (axis.tickformat or "")


def test_every_policy_gets_its_own_line():
    df = pd.DataFrame({"status": ["finished"] * 4, "ttft": [0.1, 0.2, 0.3, 0.4],
                       "tpot": [0.01] * 4, "e2e_latency": [1.0, 2, 3, 4]})
    fig = latency_cdf_figure({f"policy_{i}": df for i in range(30)})
    first = [t for t in fig.data if t.showlegend]
    assert len(first) == 30
    styles = {(t.line.color, t.line.dash) for t in first}
    assert len(styles) == 30  # never the same line twice
    assert len({t.line.color for t in first[:24]}) == 24  # a colour each up to 24
    # each label the same line in all three panels, toggled together from one legend entry
    for t in fig.data:
        twin = next(u for u in first if u.name == t.name)
        assert (t.line.color, t.line.dash, t.legendgroup) == (twin.line.color, twin.line.dash,
                                                              t.name)
    # the legend runs under the plot, where a long list wraps instead of being cut
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y < 0
    assert latency_cdf_figure({"one": df}).layout.showlegend is False


@pytest.mark.parametrize("x,text", [
    (10470.0, "10,470"), (1.04704e4, "10,470"), (27.0412, "27.04"), (650.94, "650.9"),
    (2.5341, "2.534"), (0.02345, "0.02345"), (1.5e-7, "0.00000015"), (3, "3"),
    (np.int64(1234567), "1,234,567"), (2.0, "2"), (float("nan"), ""), (-1234.5, "-1,234"),
    (0.0, "0"), ("fcfs", "fcfs"), (True, "True")])
def test_table_numbers_are_plain_decimals(x, text):
    assert format_number(x) == text


# plotly.js and the report.plotly_js option ------------------------------------------------

def test_pages_load_plotly_js_from_beside_them_and_a_sweep_shares_one_copy(tmp_path):
    page = _report(tmp_path / "run").read_text()
    assert f"src='{PLOTLY_JS_FILE}'" in page and len(page) < 1_000_000
    assert (tmp_path / "run" / PLOTLY_JS_FILE).stat().st_size > 1_000_000
    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        _report(sweep / job, shared=sweep)
    inodes = {(p / PLOTLY_JS_FILE).stat().st_ino for p in (sweep, sweep / "0", sweep / "1")}
    assert len(inodes) == 1  # one file on disk, linked into each job's folder
    # written again when stale (an older plotly), kept when current
    js = sweep / "0" / PLOTLY_JS_FILE
    js.unlink()
    js.write_text("old")
    _report(sweep / "0", "seed=1")
    assert js.stat().st_size > 1_000_000
    assert not list(sweep.rglob("*.partial"))


def test_inline_pages_carry_plotly_js(tmp_path):
    page = _report(tmp_path, options=ReportOptions(plotly_js="inline")).read_text()
    assert "<script src" not in page and "src='" not in page and len(page) > 1_000_000
    assert not (tmp_path / PLOTLY_JS_FILE).exists()


@pytest.mark.parametrize("override,why", [
    ("report.plotly_js=cdn", "must be one of directory, inline; got 'cdn'"),
    ("+report.plotly=inline", "unknown report option; known: plotly_js")])
def test_a_bad_report_option_is_a_config_error(override, why):
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        Simulation(compose_cfg(*SMALL, override))
    assert e.value.field.startswith("report.")


@pytest.mark.slow
def test_the_command_line_names_a_bad_plotly_js(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.run", *SMALL,
                        "report.plotly_js=cdn", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "config error: report.plotly_js: must be one of directory, inline; got 'cdn'")


def test_the_policies_table_has_no_exponents(tmp_path):
    cfg = compose_named("compare_policies", "scenario=long_prompts", "num_requests=12",
                        "jobs=1")
    compare_policies(cfg, tmp_path)
    page = (tmp_path / "policies.html").read_text()
    tables = "".join(re.findall(r"<table.*?</table>", page, flags=re.DOTALL))
    assert tables and not re.search(r"\de[+-]\d", tables)
    assert (tmp_path / PLOTLY_JS_FILE).exists()


# In a browser ------------------------------------------------------------------------------

def load_in_chromium(page: Path, tmp: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran (5 s of virtual time), and its console messages
    (console.* calls and uncaught exceptions, as Chromium logs them on stderr)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed")
    p = subprocess.run(
        [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    return p.stdout, console


def drawn_figures(dom: str) -> list[str]:
    """The graph divs plotly.js drew into: each one's markup."""
    parts = re.split(r"<div[^>]*class=\"(plotly-graph-div[^\"]*)\"", dom)[1:]
    return [body for cls, body in zip(parts[::2], parts[1::2])
            if "js-plotly-plot" in cls.split() and "main-svg" in body]


def assert_page_works_offline(page: Path, figures: int, tmp: Path) -> None:
    text = page.read_text()
    assert text.count("class=\"plotly-graph-div\"") == figures
    sources = re.findall(r"<script[^>]*\ssrc=['\"]([^'\"]+)", text)
    assert not [s for s in sources if re.match(r"(https?:)?//", s)], sources
    assert all((page.parent / s).is_file() for s in sources), sources
    dom, console = load_in_chromium(page, tmp)
    assert console == [], console
    # plotly.js took every graph div
    assert dom.count("class=\"plotly-graph-div js-plotly-plot\"") == figures
    drawn = drawn_figures(dom)
    assert len(drawn) == figures
    for markup in drawn:  # every figure has its axes and curves in SVG
        assert "class=\"main-svg\"" in markup and "class=\"trace scatter" in markup
        assert "class=\"xtick\"" in markup


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["directory", "inline"])
def test_report_html_draws_every_figure_in_chromium(tmp_path, mode):
    page = _report(tmp_path / "run", options=ReportOptions(plotly_js=mode))
    # latency CDFs, the timeline, the prefix cache's hit rate
    assert_page_works_offline(page, 3, tmp_path)


@pytest.mark.slow
def test_policies_html_draws_every_figure_in_chromium(tmp_path):
    cfg = compose_named("compare_policies", "scenario=long_prompts", "num_requests=12",
                        "jobs=1")
    compare_policies(cfg, tmp_path / "out")
    assert_page_works_offline(tmp_path / "out" / "policies.html", 1, tmp_path)


def test_the_browser_check_catches_a_page_that_cannot_load_plotly(tmp_path):
    page = _report(tmp_path / "run")
    (page.parent / PLOTLY_JS_FILE).unlink()
    dom, console = load_in_chromium(page, tmp_path)
    assert any("Plotly is not defined" in line for line in console), console
    assert drawn_figures(dom) == []


@pytest.mark.slow
def test_a_sweeps_pages_share_one_plotly_js_and_draw_in_chromium(tmp_path):
    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "experiments.run", "-m", "model=tiny",
                        "workload.num_requests=20", "progress=false", "workload.qps=5,20",
                        f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    copies = [sweep / PLOTLY_JS_FILE, sweep / "0" / PLOTLY_JS_FILE, sweep / "1" / PLOTLY_JS_FILE]
    assert len({c.stat().st_ino for c in copies}) == 1
    assert_page_works_offline(sweep / "sweep.html", 1, tmp_path)
    # The error bars, the latency CDFs and the timeline.
    assert_page_works_offline(sweep / "1" / "report.html", 3, tmp_path)
