"""The ``report`` config section: how the HTML pages a run writes are assembled.

Checked when a simulation is built (``sim.simulation.Simulation``), so a bad value ends the
command before anything runs; ``sim.report`` writes the pages. Kept apart from it so the check
does not import plotly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sim.errors import ConfigError, require, require_known_fields

# directory: pages load plotly.min.js written once beside them (small pages, still offline);
# inline: every page carries plotly.js itself (one self-contained file, ~4.7 MB).
PLOTLY_JS_MODES = ("directory", "inline")


@dataclass(frozen=True)
class ReportOptions:
    plotly_js: str = "directory"


def report_options(section: Any) -> ReportOptions:
    """The validated ``report`` section (None or absent keys: the defaults)."""
    if section is None:
        return ReportOptions()
    if not isinstance(section, Mapping):
        raise ConfigError("report", f"must be a mapping of report options, got {section!r}")
    require_known_fields(section, ReportOptions, "report", "report option")
    mode = section.get("plotly_js", ReportOptions.plotly_js)
    require(isinstance(mode, str) and mode in PLOTLY_JS_MODES, "report.plotly_js",
            f"must be one of {', '.join(PLOTLY_JS_MODES)}; got {mode!r}")
    return ReportOptions(plotly_js=mode)
