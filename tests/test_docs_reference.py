"""The manual stays true to the code: docs/configuration.md names every config key (every key of
``conf/*.yaml`` and ``conf/*/*.yaml``, and every field of the config classes that read them),
and every relative link in README.md and docs/*.md points to a file (and heading) that exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
REFERENCE = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Mappings whose keys are names the user chooses (variants, deployments, policy overrides per
# policy name, a pool's policy section): the mapping is documented, not each name in it.
OPEN_MAPPINGS = {
    "variants", "scenarios", "experiment.deployments", "experiment.workloads",
    "experiment.policies", "experiment.scenarios", "validate.policy_overrides",
    "validate.cost_model", "cluster.prefill.policy", "cluster.decode.policy",
    "all_reduce", "send_recv",
}
# Config groups whose files are a section of the composed config, and files that are not.
GROUPS = {"model", "hardware", "policy", "workload", "executor", "cluster"}


def _keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of ``data``'s keys, down to values, length mappings (``{dist: ...}``) and
    ``OPEN_MAPPINGS``."""
    out = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if (isinstance(value, dict) and value and "dist" not in value
                and path not in OPEN_MAPPINGS):
            out.extend(_keys(value, path))
        else:
            out.append(path)
    return out


def yaml_keys() -> dict[str, list[str]]:
    """conf file -> the dotted keys it sets (a group's file under its group's name)."""
    found = {}
    for f in sorted([*CONF.glob("*.yaml"), *CONF.glob("*/*.yaml")]):
        data = yaml.safe_load(f.read_text()) or {}
        data.pop("defaults", None)
        data.pop("hydra", None)
        group = f.parent.name
        found[str(f.relative_to(ROOT))] = _keys(data, group if group in GROUPS else "")
    return found


def _documented(path: str, text: str) -> bool:
    return f"`{path}`" in text


def test_every_conf_key_is_in_the_configuration_reference() -> None:
    text = REFERENCE.read_text()
    missing = {f: [k for k in keys if not _documented(k, text)]
               for f, keys in yaml_keys().items()}
    missing = {f: keys for f, keys in missing.items() if keys}
    assert not missing, f"docs/configuration.md lacks these keys (in backticks): {missing}"


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_every_config_class_field_is_in_the_configuration_reference() -> None:
    from experiments.intervals import ErrorBarsConfig
    from executors.cost_model import CostModelConfig
    from policies import POLICIES
    from sim.cluster.config import ClusterConfig, DisaggregatedConfig, PoolConfig
    from sim.cluster.link import LinkConfig
    from sim.report_options import ReportOptions
    from sim.simulation import SECTIONS, TOP_LEVEL, KVConfig
    from sim.specs import HardwareSpec, ModelSpec

    sections: list[tuple[str, type]] = [
        ("kv", KVConfig), ("model", ModelSpec), ("hardware", HardwareSpec),
        ("executor", CostModelConfig), ("cluster", ClusterConfig),
        ("cluster", DisaggregatedConfig), ("cluster.prefill", PoolConfig),
        ("cluster.decode", PoolConfig), ("cluster.link", LinkConfig),
        ("error_bars", ErrorBarsConfig), ("report", ReportOptions),
    ]
    sections += [("policy", POLICIES.get(name).config_class) for name in POLICIES.names()]
    paths = [f"{prefix}.{name}" for prefix, cls in sections for name in _fields(cls)]
    paths += sorted(TOP_LEVEL - set(SECTIONS))
    text = REFERENCE.read_text()
    missing = sorted({p for p in paths if not _documented(p, text)})
    assert not missing, f"docs/configuration.md lacks these keys (in backticks): {missing}"


def test_every_real_executor_option_is_in_the_configuration_reference() -> None:
    pytest.importorskip("torch")
    from executors.real.config import RealExecutorConfig

    text = REFERENCE.read_text()
    missing = [f"executor.{n}" for n in _fields(RealExecutorConfig)
               if not _documented(f"executor.{n}", text)]
    assert not missing, f"docs/configuration.md lacks these keys (in backticks): {missing}"


# ---- links --------------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.MULTILINE):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slug_matches_githubs() -> None:
    assert _slug("Sweeps") == "sweeps"
    assert _slug("`executor=real`") == "executorreal"
    assert _slug("Routers (`cluster.router`)") == "routers-clusterrouter"
    assert _slug("Validation (`experiments/validate.py`)") == "validation-experimentsvalidatepy"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: {broken}"
