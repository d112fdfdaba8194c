"""Hostile inputs end in a clear error, never a Python traceback.

* Config: every key of the composed config (each option of each config group in ``conf/``,
  ``kv.*`` and the top-level keys) set to wrong types, zero, negative, huge, subnormal and
  non-finite numbers, floats where integers belong and empty strings. Building the run and
  running it (what ``experiments.run`` does) either finishes with a strict-JSON summary or
  raises ``ConfigError`` naming the field.
* Traces: random bytes and text in several encodings, Azure CSV rows and Mooncake JSONL
  records with wrong cell counts, huge, negative and non-finite numbers, deep JSON nesting and
  over-long cells, and a folder or a missing file as the path. Every file either loads, with
  requests that keep the documented invariants, or raises ``ConfigError`` on
  ``workload.path`` naming the file (and, for a bad row, ``<file>:<line>``).
* The command line: a few of these as ``python -m experiments.run`` end with exit code 2 and
  one ``config error:`` line on stderr.
"""

from __future__ import annotations

import atexit
import copy
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.config_types import MAX_TIME_S
from sim.errors import ConfigError
from sim.report import format_summary
from tests.helpers import CONF, ROOT, compose_cfg
from workloads import make_workload
from workloads.trace import MAX_TOKENS, TraceFormatError

# ---- hostile values -------------------------------------------------------------------------
SPECIAL = [
    "", "abc", "1", "no", "x\x00y", "~nobody/x", "a" * 300,
    [], [1, 2], [[[]]], {}, {"a": 1}, {"dist": "fixed"},
    True, False, None,
    0, -1, 1, 3, 7, 2**62, 2**63, -(2**63), 10**30, 10**400,
    0.0, -0.0, 0.5, 2.5, -2.5, 1e-9, 1e-300, 1e-320, 5e-324, 1e15, 1e30, 1e300, 1e308, -1e308,
    math.nan, math.inf, -math.inf,
]
HOSTILE = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(-10, 64),
    st.floats(-1e3, 1e3),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not -1e3 <= x <= 1e3),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
)

FUZZ = settings(deadline=None, max_examples=20, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# ---- the composed configs -------------------------------------------------------------------
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
          for g in ("policy", "model", "hardware", "workload", "executor", "cluster")}
SMALL_WORKLOAD = {
    "synthetic": ["workload.num_requests=5", "workload.output_len.max=48"],
    "vidur_bench": ["workload.num_requests=5"],
    "multi_turn": ["workload.num_sessions=3", "workload.turns.max=3"],
    "trace": [],  # a small trace file of its own (below)
}
# Models that do not fit one A100-80GB run on eight, as pipeline stages of eight GPUs.
FIT = [[], ["cluster.tensor_parallel_size=8"],
       ["cluster.tensor_parallel_size=8", "cluster.pipeline_parallel_size=2"],
       ["cluster.tensor_parallel_size=8", "cluster.pipeline_parallel_size=4"]]


@cache
def small_trace() -> str:
    folder = tempfile.mkdtemp(prefix="fuzz-trace-")
    atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "0,100,20\n0.5,300,5\n1.25,50,40\n2,1000,1\n")
    return str(path)


@cache
def scratch_dir() -> Path:
    """This process's folder for the runs' outputs and the trace files, emptied after each
    check: creating and removing a folder per check costs more than most checks (a few ms
    on ext4), and most checks are refused before they write anything."""
    folder = Path(tempfile.mkdtemp(prefix="fuzz-out-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def empty(folder: Path) -> None:
    """Remove everything in ``folder``: the next check starts from an empty folder, as from
    a fresh one."""
    for path in folder.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@cache
def base_config(group: str | None, option: str | None) -> dict[str, Any]:
    """The composed config of ``group=option`` (the defaults for the rest) on a small
    workload, in parallelism its model fits: a run that builds and finishes."""
    chosen = [f"{group}={option}"] if group else []
    workload = option if group == "workload" else "synthetic"
    for fit in FIT:
        cfg = compose_cfg(*chosen, *SMALL_WORKLOAD[workload], *fit)
        if workload == "trace":
            cfg["workload"]["path"] = small_trace()
        try:
            Simulation(copy.deepcopy(cfg))
        except ConfigError:
            continue
        return cfg
    raise AssertionError(f"no parallelism fits {chosen}")


def keys(cfg: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of ``cfg``, mappings and their keys alike."""
    out = []
    for k, v in cfg.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += keys(v, (*prefix, k))
    return out


def group_keys(group: str | None, option: str | None) -> list[tuple[str, ...]]:
    """The keys of the group's own section; for ``None``, the top-level keys and ``kv.*``."""
    cfg = base_config(group, option)
    if group is not None:
        return [k for k in keys(cfg) if k[0] == group]
    return [k for k in keys(cfg) if k[0] not in GROUPS]


def with_value(cfg: dict[str, Any], key: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    section = out
    for k in key[:-1]:
        section = section[k]
    section[key[-1]] = copy.deepcopy(value)
    return out


def _has(cfg: dict[str, Any], field: str) -> bool:
    """Whether ``field`` (dotted, maybe with a ``[i]`` index) is a key of ``cfg``."""
    section: Any = cfg
    for k in re.sub(r"\[\d+\]", "", field).split("."):
        if not isinstance(section, dict) or k not in section:
            return False
        section = section[k]
    return True


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _names_a_changed_field(base: dict[str, Any], changes: dict[tuple[str, ...], Any],
                           field: str) -> bool:
    """Whether an error on ``field`` is one ``changes`` of ``base`` may cause: on a changed
    key (or inside it, or the section holding it); for a value of the key's own kind, on any
    field of the config (a model that no longer fits names the parallelism); for a key set to
    null, on any field of its section (one may be needed in its place). A disaggregated
    pool's policy is the run's merged with its own: its errors name the pool's."""
    run_policy = re.sub(r"^cluster\.(prefill|decode)\.policy\b", "policy", field)
    # The real executor's device is the top-level one (conf/executor/real.yaml).
    device = "executor.device" if field == "device" else field
    return any(_explains(base, changes, f) for f in {field, run_policy, device})


def _explains(base: dict[str, Any], changes: dict[tuple[str, ...], Any], field: str) -> bool:
    for key, value in changes.items():
        name = ".".join(key)
        if (field == name or field.startswith((f"{name}.", f"{name}["))
                or name.startswith(f"{field}.")):
            return True
        original: Any = base
        for k in key:
            original = original[k]
        if (original is None or _kind(value) == _kind(original)) and _has(base, field):
            return True
        if value is None and field.split(".")[0] == key[0]:
            return True
    return False


def check_build_and_run(base: dict[str, Any], changes: dict[tuple[str, ...], Any]) -> str:
    """Build and run ``base`` with each key of ``changes`` set to its value: a finished run
    with a strict-JSON summary, or a ConfigError naming a field they explain. Returns which."""
    cfg = base
    for key, value in changes.items():
        cfg = with_value(cfg, key, value)
    shown = {".".join(k): v for k, v in changes.items()}
    out = scratch_dir()
    try:
        try:
            result = Simulation(cfg, out).run()
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message and message.startswith(f"{e.field}: "), message
            assert _names_a_changed_field(base, changes, e.field), (shown, message)
            return "refused"
        summary = json.loads((out / "summary.json").read_text(),
                             parse_constant=lambda c: pytest.fail(f"{shown}: {c}"))
    finally:
        empty(out)
    assert summary["status"] == "complete"
    raw = result.summary
    if any(isinstance(v, float) and math.isnan(v) for v in raw.values()):
        pytest.fail(f"{shown}: NaN in the summary: {raw}")
    format_summary(raw)  # what the command logs
    return "ran"


def leaf_keys(cfg: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for key in keys(cfg):
        value: Any = cfg
        for k in key:
            value = value[k]
        if not isinstance(value, dict):
            out.append(key)
    return out


CASES = [(None, None)] + [(g, o) for g, options in GROUPS.items() for o in options
                          if (g, o) != ("executor", "real")]


@pytest.mark.parametrize("group,option", CASES,
                         ids=[f"{g}={o}" if g else "top-level+kv" for g, o in CASES])
@FUZZ
@given(data=st.data())
def test_a_hostile_config_value_is_refused_naming_its_field_or_runs(group, option, data):
    key = data.draw(st.sampled_from(group_keys(group, option)), label="key")
    value = data.draw(HOSTILE, label="value")
    event(check_build_and_run(base_config(group, option), {key: value}))


def test_a_huge_step_time_factor_is_refused():
    """A factor that would price steps at infinity (latencies NaN) is refused by name."""
    assert check_build_and_run(base_config(None, None),
                               {("executor", "step_time_factor"): 1e308}) == "refused"


@pytest.mark.parametrize("profile", ["folder", "utf16"])
def test_a_folder_or_undecodable_file_as_the_cost_model_profile_is_refused(tmp_path, profile):
    path = tmp_path
    if profile == "utf16":
        path = tmp_path / "profile.yaml"
        path.write_bytes("model: tiny\n".encode("utf-16"))
    cfg = with_value(base_config(None, None), ("executor", "profile"), str(path))
    with pytest.raises(ConfigError, match=r"^executor\.profile: "):
        Simulation(cfg)


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_hostile_values_in_several_keys_at_once_are_refused_or_run(data):
    group, option = data.draw(st.sampled_from(CASES), label="config")
    base = base_config(group, option)
    chosen = data.draw(st.lists(st.sampled_from(leaf_keys(base)), min_size=2, max_size=3,
                                unique=True), label="keys")
    event(check_build_and_run(base, {k: data.draw(HOSTILE, label=".".join(k)) for k in chosen}))


@pytest.mark.slow
@pytest.mark.parametrize("group,option", CASES,
                         ids=[f"{g}={o}" if g else "top-level+kv" for g, o in CASES])
def test_every_key_takes_every_special_value(group, option):
    base = base_config(group, option)
    for key in group_keys(group, option):
        for value in SPECIAL:
            check_build_and_run(base, {key: value})


@pytest.mark.slow
@settings(deadline=None, max_examples=15, derandomize=True)
@given(data=st.data())
def test_a_hostile_real_executor_value_is_refused_naming_its_field_or_runs(data):
    pytest.importorskip("torch")
    base = compose_cfg("executor=real", "model=tiny", "device=cpu", "workload.num_requests=2",
                       "workload.prompt_len.max=64", "workload.output_len.max=4",
                       "executor.warmup=false")
    key = data.draw(st.sampled_from([k for k in keys(base) if k[0] == "executor"]
                                    + [("device",)]))
    check_build_and_run(base, {key: data.draw(HOSTILE)})


# ---- trace files ----------------------------------------------------------------------------
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
CELLS = st.one_of(
    st.integers(-3, 5000).map(str),
    st.sampled_from([
        "", " ", "nan", "NaN", "inf", "-inf", "Infinity", "1e30", "-1", "-0", "0.5", "7.0",
        "1e-320", "9" * 400, "1" + "0" * 30, "2023-11-16 18:00:00", "2023-11-16T18:00:00Z",
        "2023-11-16T18:00:01.1234567+05:30", "0001-01-01T00:00:00", "9999-12-31T23:59:59",
        "1e300", "8589934593", "x" * 200_000, '"a,b"', '"', "1_000", "0x10", "\x00", "é", "\u2028",
    ]),
    st.floats().map(repr),
    st.text(max_size=6),
)
ROWS = st.lists(st.lists(CELLS, max_size=5), max_size=6)
JSON_NUMBERS = st.one_of(
    st.integers(-3, 10**6), st.floats(), st.sampled_from([10**400, -(10**30), 2**64, 2**31]),
)
JSON_VALUES = st.recursive(
    st.one_of(JSON_NUMBERS, st.booleans(), st.none(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)
RECORDS = st.fixed_dictionaries({}, optional={
    "timestamp": st.one_of(JSON_NUMBERS, JSON_VALUES),
    "input_length": st.one_of(JSON_NUMBERS, JSON_VALUES),
    "output_length": st.one_of(JSON_NUMBERS, JSON_VALUES),
    "hash_ids": st.one_of(st.lists(st.one_of(st.integers(-1, 2**65), st.booleans()), max_size=4),
                          JSON_VALUES),
    "extra": JSON_VALUES,
})
MOONCAKE_LINE = st.one_of(
    RECORDS.map(json.dumps),
    st.sampled_from([
        "", "{", "[]", "null", "5", '"text"', "{" * 50_000 + "}" * 50_000,
        "[" * 100_000 + "]" * 100_000, '{"timestamp": ' + "9" * 5000 + "}",
        '{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [' + "1," * 50_000
        + "1]}",
    ]),
    st.text(max_size=20),
)
ENCODINGS = ["utf-8", "utf-8-sig", "latin-1", "utf-16", "utf-16-le", "utf-32"]


@st.composite
def azure_file(draw) -> bytes:
    header = draw(st.one_of(st.just(HEADER), st.just(HEADER + ",extra"), st.text(max_size=20)))
    rows = [header] + [",".join(r) for r in draw(ROWS)]
    text = draw(st.sampled_from(["\n", "\r\n", "\r"])).join(rows) + draw(st.sampled_from(["", "\n"]))
    return text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")


@st.composite
def mooncake_file(draw) -> bytes:
    text = "\n".join(draw(st.lists(MOONCAKE_LINE, max_size=5)))
    return text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")


VALID_ROW = st.tuples(
    st.one_of(st.floats(0, 1e6).map(repr), st.integers(0, 10**6).map(str),
              st.just("2023-11-16 18:00:00")),
    st.integers(1, 5000).map(str), st.integers(0, 5000).map(str))


@st.composite
def mostly_valid_azure_file(draw) -> bytes:
    """Valid rows, now and then one with a hostile cell, a cell more or a cell less."""
    rows = [list(r) for r in draw(st.lists(VALID_ROW, min_size=1, max_size=8))]
    for row in rows:
        change = draw(st.sampled_from(["none"] * 6 + ["cell", "more", "less"]))
        if change == "cell":
            row[draw(st.integers(0, 2))] = draw(CELLS)
        elif change == "more":
            row.append(draw(CELLS))
        elif change == "less":
            row.pop()
    return "\n".join([HEADER] + [",".join(r) for r in rows]).encode()


@st.composite
def mostly_valid_mooncake_file(draw) -> bytes:
    records = draw(st.lists(st.fixed_dictionaries({
        "timestamp": st.integers(0, 10**9), "input_length": st.integers(1, 5000),
        "output_length": st.integers(0, 5000),
        "hash_ids": st.lists(st.integers(0, 2**64 - 1), max_size=12)}), min_size=1, max_size=8))
    lines = [json.dumps(r) for r in records]
    if draw(st.booleans()):
        lines[draw(st.integers(0, len(lines) - 1))] = draw(MOONCAKE_LINE)
    return "\n".join(lines).encode()


TRACE_FILES = st.one_of(
    mostly_valid_azure_file(),
    mostly_valid_mooncake_file(),
    st.binary(max_size=200),
    st.builds(lambda t, enc: t.encode(enc, errors="replace"), st.text(max_size=80),
              st.sampled_from(ENCODINGS)),
    azure_file(),
    mooncake_file(),
)


def check_trace(path: Path, expected_rows: int | None = None) -> str:
    """Load ``path`` as a trace: requests that keep the documented invariants, or a
    ConfigError on workload.path naming the file (and the line, for a bad row)."""
    try:
        w = make_workload({"name": "trace", "path": str(path)}, seed=0)
    except TraceFormatError as e:
        assert e.field == "workload.path", e
        found = re.match(rf"workload\.path: {re.escape(str(path))}:(\d+): \S", str(e))
        assert found, str(e)
        assert "\n" not in str(e) and len(str(e)) < 600, str(e)[:600]
        return "refused"
    except ConfigError as e:  # a folder, a missing file, no rows, a span beyond MAX_TIME_S
        assert e.field == "workload.path" and str(path) in str(e), str(e)
        assert "\n" not in str(e), str(e)
        return "refused"
    reqs = list(w)
    assert len(reqs) == w.num_requests >= 1
    if expected_rows is not None:
        assert len(reqs) == expected_rows, "rows dropped or added"
    times = [r.arrival_time for r in reqs]
    assert times[0] == 0 and all(math.isfinite(t) for t in times)
    assert times == sorted(times) and times[-1] <= MAX_TIME_S
    assert [r.request_id for r in reqs] == list(range(len(reqs)))
    for r in reqs:
        assert type(r.prompt_len) is int and 1 <= r.prompt_len <= MAX_TOKENS
        assert type(r.max_output_len) is int and 1 <= r.max_output_len <= MAX_TOKENS
    assert w.max_prompt_len == max(r.prompt_len for r in reqs)
    return "loaded"


def _data_rows(data: bytes, suffix: str) -> int | None:
    """Non-blank rows after the header (CSV) or non-blank lines (JSONL) of UTF-8 ``data``."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    lines = io.StringIO(text, newline=None)
    if suffix == ".jsonl" or text.lstrip().startswith("{"):
        return sum(1 for line in lines if line.strip())
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error:
        return None
    return sum(1 for row in rows[1:] if any(c.strip() for c in row))


@pytest.mark.slow
@settings(FUZZ, max_examples=300)
@given(data=TRACE_FILES, suffix=st.sampled_from([".csv", ".jsonl", ".json", ""]))
def test_a_hostile_trace_file_loads_or_is_refused_at_its_line(data, suffix):
    path = scratch_dir() / f"trace{suffix}"
    try:
        path.write_bytes(data)
        event(check_trace(path, _data_rows(data, suffix)))
    finally:
        empty(scratch_dir())


@pytest.mark.parametrize("make", ["folder", "missing", "empty", "header only", "blank lines"])
def test_a_trace_path_that_holds_no_rows_is_refused(tmp_path, make):
    path = tmp_path / "trace.csv"
    if make == "folder":
        path.mkdir()
    elif make != "missing":
        path.write_text({"empty": "", "header only": HEADER + "\n", "blank lines": "\n\n"}[make])
    assert check_trace(path) == "refused"


@pytest.mark.parametrize("text,line,why", [
    (HEADER + "\n0,10,5\n1,10,5,\n2,10,5,6\n", 4, "expected 3 columns"),
    (HEADER + "\n0,10,5\n1," + "9" * 400 + ",5\n", 3, "ContextTokens must be a finite number"),
    (HEADER + "\n0,10,5\n1,1e30,5\n", 3, "ContextTokens must be an integer in [1, "),
    (HEADER + "\n0,10,5\n1e300,10,5\n", 3, "TIMESTAMP must be <= 8589934592 s"),
    (HEADER + "\n0,10,5\n1,10,-5\n", 3, "GeneratedTokens must be an integer in [0, "),
    (HEADER + "\n0,10,5\n1,10,\x00\n", 3, ""),
    (HEADER + "\n0,10,5\n1,10,5\n2,10,\xe9\n", 4, "not UTF-8 text (byte 0xe9)"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n'
     '{"timestamp": ' + "9" * 400 + ', "input_length": 1, "output_length": 1}', 3,
     "timestamp must be a finite number"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n' + "[" * 100_000, 2,
     "not a Mooncake record (JSON nested too deep)"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [true]}', 1,
     "hash_ids must be a list of integers in [0, 2^64)"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [' + str(2**64)
     + "]}", 1, "hash_ids must be a list of integers in [0, 2^64)"),
])
def test_a_bad_trace_row_is_refused_at_its_line(tmp_path, text, line, why):
    path = tmp_path / ("t.jsonl" if text.startswith("{") else "t.csv")
    path.write_bytes(text.encode("latin-1") if "\xe9" in text else text.encode())
    with pytest.raises(TraceFormatError) as e:
        make_workload({"name": "trace", "path": str(path)}, seed=0)
    assert str(e.value).startswith(f"workload.path: {path}:{line}: {why}"), str(e.value)[:300]


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig"])
def test_a_utf8_trace_with_or_without_a_byte_order_mark_loads(tmp_path, encoding):
    path = tmp_path / "t.csv"
    path.write_bytes((HEADER + "\n0,10,5\n1.5,20,0\n").encode(encoding))
    assert check_trace(path, 2) == "loaded"


def test_a_utf16_trace_is_refused_naming_its_encoding(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes((HEADER + "\n0,10,5\n").encode("utf-16"))
    with pytest.raises(TraceFormatError, match=r":1: UTF-16 or UTF-32 text"):
        make_workload({"name": "trace", "path": str(path)}, seed=0)


def test_a_trace_whose_span_float_times_cannot_carry_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "\n0,10,5\n8000000000,10,5\n")
    with pytest.raises(ConfigError, match=r"^workload\.path: .*span 8e\+09 s"):
        make_workload({"name": "trace", "path": str(path)}, seed=0)
    path.write_text(HEADER + "\n0,10,5\n200000000,10,5\n")
    assert make_workload({"name": "trace", "path": str(path)}, seed=0).num_requests == 2
    with pytest.raises(ConfigError, match=r"^workload\.time_scale: .*span 2e\+09 s"):
        make_workload({"name": "trace", "path": str(path), "time_scale": 10}, seed=0)


# ---- the command line -----------------------------------------------------------------------
def _latin1_trace(folder: Path) -> str:
    path = folder / "latin1.csv"
    path.write_bytes(f"{HEADER}\n0,10,5\n1,caf\xe9,5\n".encode("latin-1"))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,line", [
    (["workload.num_requests=1e30"],
     ("config error: workload.num_requests: must be an integer of magnitude below 2**63, got "
      "1e+30")),
    (["model.weight_dtype=[1]"], "config error: model.weight_dtype: must be a string, got [1]"),
    (["hardware.memory_bandwidth_gbps=1e-320"],
     ("config error: hardware.memory_bandwidth_gbps: must be 0 or at least 2.23e-308 in "
      "magnitude (a subnormal float), got 1e-320")),
    (["executor.step_overhead_ms=1e300"],
     ("config error: executor.step_overhead_ms: must be at most 1e+12 in magnitude (a longer "
      "time leaves the simulated clock where floats cannot carry microseconds), got 1e+300")),
    (["policy=sjf", "policy.bucket_edges=3"],
     ("config error: policy.bucket_edges: must be two increasing positive lengths [short, "
      "medium], got 3")),
    (["workload=trace", "workload.path={tmp}"],
     "config error: workload.path: {tmp} is a folder, not a file"),
    (["workload=trace", "workload.path={latin1}"],
     "config error: workload.path: {latin1}:3: not UTF-8 text (byte 0xe9)"),
])
def test_the_command_line_ends_a_hostile_value_with_one_line_and_exit_code_2(
        tmp_path, overrides, line):
    names = {"tmp": str(tmp_path), "latin1": _latin1_trace(tmp_path)}
    overrides = [o.format(**names) for o in overrides]
    run = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"hydra.run.dir={tmp_path / 'run'}",
         "progress=false", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [line.format(**names)]


@pytest.mark.parametrize("override,start", [
    ("workload.qpss=3", "config error: Could not override 'workload.qpss'."),
    ("model=nosuch", "config error: In 'config': Could not find 'model/nosuch'"),
    ("workload.qps=[1,2", "config error: no viable alternative at input '[1,2'"),
    ("device=${nosuch}", "config error: device: Interpolation key 'nosuch' not found"),
])
def test_the_command_line_ends_an_override_hydra_refuses_with_one_line_and_exit_code_2(
        tmp_path, override, start):
    run = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"hydra.run.dir={tmp_path}", override],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith(start), run.stderr
