"""Replay of a request trace: Azure LLM trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)
or Mooncake JSONL (``{"timestamp": ms, "input_length", "output_length", ...}``): a ``.jsonl``
file, or any file whose first line opens a JSON object. An Azure file may have columns after
the three (ignored), but every row has as many cells as its header (trailing empty ones
aside).
A request with zero generated tokens is replayed with one: a serving engine samples at least
the prefill's token. The file is UTF-8 text (a byte-order mark is skipped); other bytes, a row
the format cannot hold, a token count beyond ``MAX_TOKENS`` and a time beyond
``MAX_TRACE_TIME_S`` are refused with the file and line.

The file is parsed whole before the run (a few columns of numbers, cheap even for millions of
rows), so that a malformed row is refused up front with its file and line; Requests are still
created lazily.

Times: a trace is one time axis. Azure ``TIMESTAMP`` is either a number of seconds >= 0 or an
ISO date; dates are either all naive (read as UTC, so no machine's local zone or daylight-saving
shift enters) or all with a UTC offset (offsets may differ: each names one instant). A file that
mixes numbers, naive dates and dates with offsets is refused at the first row that differs from
the first row, as is a negative number (Azure seconds or Mooncake milliseconds). Rows out of
time order are replayed in time order (a stable sort: equal times keep the file's order);
``start`` and ``num_requests`` then count in that order. The replayed span (times ``time_scale``)
stays within ``sim.config_types.MAX_TIME_S``.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import math
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from sim.config_types import MAX_TIME_S, as_float, as_int
from sim.errors import ConfigError, require
from sim.request import Request
from workloads.base import WORKLOADS, Workload, resolve_path
from workloads.distributions import MAX_LENGTH
from workloads.synthetic import token_id_source
from workloads.token_ids import MOONCAKE_BLOCK_TOKENS, TokenIdSource

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# A token count beyond this is no request a model serves (model.max_model_len's bound).
MAX_TOKENS = MAX_LENGTH
# Numeric times beyond 2^33 s (the year 2242 as Unix time) are spaced more than 1.9 us apart
# as floats: the gaps between arrivals would be rounded.
MAX_TRACE_TIME_S = float(2**33)


class TraceFormatError(ConfigError):
    def __init__(self, path: Path, line: int, message: str) -> None:
        super().__init__("workload.path", f"{path}:{line}: {message}")


# The three kinds of Azure TIMESTAMP; a trace must use one.
NUMBER, NAIVE_DATE, OFFSET_DATE = "a number", "a date without UTC offset", "a date with UTC offset"


_FRACTION = re.compile(r"(\.\d{6})\d+")


def _iso_for_any_python(value: str) -> str:
    """What ``datetime.fromisoformat`` of Python 3.11+ reads, in the subset 3.10 reads too:
    a trailing ``Z`` as ``+00:00`` and fractions of a second cut to microseconds (as 3.11
    cuts them; Azure's traces write seven digits)."""
    value = value.strip()
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"
    return _FRACTION.sub(r"\1", value, count=1)


def _parse_time(value: str, what: str, path: Path, line: int) -> tuple[float, str]:
    """Seconds and the kind of the value (``NUMBER``, ``NAIVE_DATE``, ``OFFSET_DATE``): a
    finite number >= 0 or an ISO date (naive ones read as UTC). NaN or infinity would sort
    arbitrarily and put NaN into every time the run reports, so they are refused."""
    try:
        t = float(value)
    except ValueError:
        try:
            d = datetime.fromisoformat(_iso_for_any_python(value))
        except ValueError:
            raise TraceFormatError(path, line, f"{what} {_short(value)} does not parse"
                                   ) from None
        if d.tzinfo is None:
            return d.replace(tzinfo=timezone.utc).timestamp(), NAIVE_DATE
        return d.timestamp(), OFFSET_DATE
    if not math.isfinite(t):
        raise TraceFormatError(path, line, f"{what} must be a finite number, got {value!r}")
    if t < 0:
        raise TraceFormatError(path, line, f"{what} must be >= 0, got {value!r}")
    if t > MAX_TRACE_TIME_S:
        raise TraceFormatError(path, line, f"{what} must be <= {MAX_TRACE_TIME_S:.0f} s, got "
                                           f"{_short(value)}")
    return t, NUMBER


def _cut(error: Exception) -> str:
    """An error's message, cut to 80 characters."""
    text = str(error)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _short(value: Any) -> str:
    """``repr(value)``, cut to 40 characters (a cell may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _finite(value: Any, what: str, path: Path, line: int) -> float:
    """A finite number (json.loads takes NaN and Infinity; a JSON true is no number)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        f = float(value)
    except (TypeError, ValueError):
        raise TraceFormatError(path, line, f"{what} {_short(value)} is not a number") from None
    except OverflowError:  # an integer beyond float's range
        f = math.inf
    if not math.isfinite(f):
        raise TraceFormatError(path, line, f"{what} must be a finite number, got "
                                           f"{_short(value)}")
    return f


def _positive_int(value: Any, what: str, path: Path, line: int, minimum: int) -> int:
    f = _finite(value, what, path, line)
    if f != int(f) or not minimum <= f <= MAX_TOKENS:
        raise TraceFormatError(path, line, f"{what} must be an integer in [{minimum}, "
                                           f"{MAX_TOKENS}], got {_short(value)}")
    return int(f)


def read_text(path: Path) -> str:
    """The trace file as text: UTF-8, a leading byte-order mark skipped. Bytes that are not
    UTF-8 (Latin-1, UTF-16, binary data) are refused at their line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError("workload.path", f"{path}: cannot read: {e.strerror or e}") from None
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE,
                        codecs.BOM_UTF16_BE)) and not data.startswith(codecs.BOM_UTF8):
        raise TraceFormatError(path, 1, "UTF-16 or UTF-32 text (a byte-order mark); save the "
                                        "trace as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        before = data[:e.start].decode("utf-8-sig")
        line = before.count("\n") + before.count("\r") - before.count("\r\n") + 1
        raise TraceFormatError(path, line, f"not UTF-8 text (byte 0x{data[e.start]:02x})"
                               ) from None


def _opens_json(text: str) -> bool:
    for line in io.StringIO(text, newline=None):
        if line.strip():
            return line.lstrip().startswith("{")
    return False


def is_jsonl(path: Path) -> bool:
    """Whether the trace is Mooncake JSONL: a ``.jsonl`` file (so a damaged first record gets
    the JSON reader's error), or any other file whose first non-blank line opens a JSON
    object (a ``.json`` name); anything else is read as an Azure CSV."""
    return path.suffix == ".jsonl" or _opens_json(read_text(path))


def read_azure_csv(path: Path, text: str | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
    """Times, input and output lengths of an Azure CSV (``text``: the file's, if read)."""
    reader = csv.reader(io.StringIO(read_text(path) if text is None else text, newline=""))
    try:
        return _azure_rows(path, reader)
    except csv.Error as e:  # a NUL byte, a cell beyond the csv module's size limit
        raise TraceFormatError(path, reader.line_num, f"not a CSV row ({e})") from None


def _azure_rows(path: Path, reader: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    times, ins, outs = [], [], []
    first: tuple[str, int, str] | None = None  # the first row's time kind, line and value
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header[:3]) != AZURE_COLUMNS:
        raise TraceFormatError(path, 1, f"expected header {','.join(AZURE_COLUMNS)}, "
                                        f"got {_short(','.join(header or []))}")
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        while len(row) > len(header) and not row[-1].strip():
            row.pop()  # a trailing comma (spreadsheet exports) adds an empty cell
        if len(row) != len(header):  # a cell too many is as malformed as one too few
            raise TraceFormatError(path, line, f"expected {len(header)} columns (as the "
                                   f"header), got {len(row)}")
        value = row[0].strip()
        t, kind = _parse_time(value, "TIMESTAMP", path, line)
        if first is None:
            first = (kind, line, value)
        elif kind != first[0]:
            # Naive and zone-aware times (or numbers and dates) share no time axis: any
            # gap between them would be an artefact of how the reader fills the zone in.
            raise TraceFormatError(path, line, f"TIMESTAMP {_short(value)} is {kind}, but "
                                   f"line {first[1]}'s {_short(first[2])} is {first[0]}: a trace's "
                                   f"times must all be of one kind")
        times.append(t)
        ins.append(_positive_int(row[1], "ContextTokens", path, line, 1))
        outs.append(_positive_int(row[2], "GeneratedTokens", path, line, 0))
    return np.asarray(times), np.asarray(ins), np.asarray(outs)


def read_mooncake_jsonl(path: Path, text: str | None = None,
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int] | None],
                                   np.ndarray]:
    """Times, input and output lengths, each row's ``hash_ids`` (None if absent) and line
    (``text``: the file's, if read)."""
    times, ins, outs, hashes, lines = [], [], [], [], []
    f = io.StringIO(read_text(path) if text is None else text, newline=None)
    for line, record in enumerate(f, start=1):
        if not record.strip():
            continue
        try:
            row = json.loads(record)
            raw = row["timestamp"]
        except (ValueError, KeyError, TypeError) as e:
            raise TraceFormatError(path, line, f"not a Mooncake record ({_cut(e)})"
                                   ) from None
        except RecursionError:
            raise TraceFormatError(path, line, "not a Mooncake record (JSON nested too "
                                               "deep)") from None
        for key in ("input_length", "output_length"):
            if key not in row:
                raise TraceFormatError(path, line, f"missing {key!r} (a Mooncake record "
                                       "has timestamp, input_length, output_length)")
        ms = _finite(raw, "timestamp", path, line)
        if ms < 0:  # milliseconds from the trace's start
            raise TraceFormatError(path, line, f"timestamp must be >= 0, got {_short(raw)}")
        if ms > MAX_TRACE_TIME_S * 1000:
            raise TraceFormatError(path, line, f"timestamp must be <= "
                                   f"{MAX_TRACE_TIME_S * 1000:.0f} ms, got {_short(raw)}")
        times.append(ms / 1000.0)
        ins.append(_positive_int(row.get("input_length"), "input_length", path, line, 1))
        outs.append(_positive_int(row.get("output_length"), "output_length", path, line, 0))
        h = row.get("hash_ids")
        if h is not None and not (isinstance(h, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64
                for x in h)):
            raise TraceFormatError(path, line, "hash_ids must be a list of integers in "
                                               "[0, 2^64)")
        hashes.append(h)
        lines.append(line)
    return np.asarray(times), np.asarray(ins), np.asarray(outs), hashes, np.asarray(lines)


class TraceWorkload(Workload):
    def __init__(self, path: Path, time_scale: float = 1.0, num_requests: int | None = None,
                 max_output_len: int | None = None, start: int = 0,
                 token_ids: TokenIdSource | None = None) -> None:
        require(time_scale > 0, "workload.time_scale", f"must be > 0, got {time_scale}")
        require(num_requests is None or num_requests >= 1, "workload.num_requests",
                f"must be >= 1, got {num_requests}")
        require(start >= 0, "workload.start", f"must be >= 0, got {start}")
        require(max_output_len is None or max_output_len >= 1, "workload.max_output_len",
                f"must be >= 1 or null, got {max_output_len}")
        self.path = path
        hashes: list[list[int] | None] | None = None
        text = read_text(path)
        if path.suffix == ".jsonl" or _opens_json(text):
            times, ins, outs, hashes, lines = read_mooncake_jsonl(path, text)
        else:
            times, ins, outs = read_azure_csv(path, text)
        if len(times) == 0:
            raise ConfigError("workload.path", f"{path}: the trace has no rows")
        total = len(times)
        # Replay in time order; stable, so rows with equal times keep the file's order.
        order = np.argsort(times, kind="stable")
        end = total if num_requests is None else start + num_requests
        order = order[start:end]
        times, ins, outs = times[order], ins[order], outs[order]
        if len(times) == 0:
            raise ConfigError("workload.start", f"{path} has only {total} rows")
        span = float(times[-1] - times[0]) * time_scale
        if span > MAX_TIME_S:
            raise ConfigError("workload.time_scale" if time_scale != 1 else "workload.path", (
                f"{path}: the replayed rows span {span:.3g} s (time_scale {time_scale}), "
                f"beyond {MAX_TIME_S:g} s of simulated time (float times there cannot carry "
                f"microsecond latencies)"))
        self.token_ids = token_ids
        # Mooncake rows name their 512-token prompt blocks: equal hash ids, equal content.
        # The prefix cache sees each full block as one span keyed by its hash id (the partial
        # last block is the request's own).
        self._prefixes: list[tuple[tuple[int, int], ...] | None] | None = None
        if hashes is not None:
            self._prefixes = [
                None if hashes[i] is None else tuple(
                    (h, MOONCAKE_BLOCK_TOKENS) for h in hashes[i][:n // MOONCAKE_BLOCK_TOKENS])
                for i, n in zip(order.tolist(), ins.tolist())]
        self._hashes: list[list[int]] | None = None
        if token_ids is not None and hashes is not None:
            self._hashes = []
            for i, n in zip(order.tolist(), ins.tolist()):
                h = hashes[i]
                if h is None or len(h) * MOONCAKE_BLOCK_TOKENS < n:
                    have = 0 if h is None else len(h)
                    raise TraceFormatError(path, int(lines[i]), f"{have} hash_ids cannot cover "
                                           f"input_length {n} in {MOONCAKE_BLOCK_TOKENS}-token "
                                           f"blocks (token ids are derived from them)")
                self._hashes.append(h)
        # A request with zero generated tokens still produces one token in a serving engine.
        outs = np.maximum(outs, 1)
        if max_output_len is not None:
            outs = np.minimum(outs, max_output_len)
        self._times = (times - times[0]) * time_scale
        self._ins = ins
        self._outs = outs

    @property
    def num_requests(self) -> int:
        return len(self._times)

    @property
    def max_prompt_len(self) -> int:
        return int(self._ins.max())

    def __iter__(self) -> Iterator[Request]:
        tok, hashes, prefixes = self.token_ids, self._hashes, self._prefixes
        for rid, (t, i, o) in enumerate(zip(self._times.tolist(), self._ins.tolist(),
                                            self._outs.tolist())):
            ids = None
            if tok is not None:
                ids = tok.mooncake(hashes[rid], i) if hashes is not None else tok.synthetic(rid, i)
            yield Request(rid, t, i, o, prompt_token_ids=ids,
                          prefix=None if prefixes is None else prefixes[rid] or None)

    def describe(self) -> str:
        span = self._times[-1] if len(self._times) > 1 else 0.0
        return f"trace {self.path.name}: {self.num_requests} requests over {span:.0f} s"


@WORKLOADS.register("trace")
def build_trace(cfg: dict[str, Any], seed: int, model: Any = None, token_ids: bool = False,
                **_: Any) -> TraceWorkload:
    """``token_ids=True`` (an executor that samples real tokens) turns prompt ids on."""
    cfg = dict(cfg)
    known = {"path", "time_scale", "num_requests", "max_output_len", "start", "token_ids"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"workload.{unknown[0]}",
                          f"unknown option for a trace workload; known: {', '.join(sorted(known))}")
    if not cfg.get("path"):
        raise ConfigError("workload.path", "required for a trace workload")
    def optional_int(key: str) -> int | None:
        value = cfg.get(key)
        return None if value is None else as_int(value, f"workload.{key}")

    return TraceWorkload(resolve_path(str(cfg["path"]), "workload.path", file=True),
                         time_scale=as_float(cfg.get("time_scale", 1.0), "workload.time_scale"),
                         num_requests=optional_int("num_requests"),
                         max_output_len=optional_int("max_output_len"),
                         start=as_int(cfg.get("start", 0), "workload.start"),
                         token_ids=token_id_source(cfg, seed, model, token_ids, prefixes=False))
