"""Row writers for ``requests.csv`` and ``steps.csv``: rows are written as they happen, so a
long run holds no per-request or per-step history in memory."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable
from itertools import repeat
from operator import truediv
from pathlib import Path
from typing import IO, Any

from sim.request import Request, RequestStatus

REQUEST_COLUMNS = (
    "request_id", "replica_id", "status", "reject_reason", "priority", "arrival_time",
    "prompt_len", "max_output_len", "output_len", "first_scheduled_time", "first_token_time",
    "finish_time", "queue_delay", "ttft", "tpot", "e2e_latency", "num_preemptions",
    "num_swaps", "num_recomputes", "num_cached_tokens", "output_token_ids",
)

STEP_COLUMNS = (
    "step", "replica_id", "time", "duration", "batch_size", "prefill_tokens", "decode_tokens",
    "sampled", "num_waiting", "num_running", "num_swapped", "kv_blocks_used", "kv_usage",
    "recomputed", "swapped_out", "swap_out_blocks", "swap_in_blocks",
)


# steps.csv rows of numbers (time and duration already repr strings), as csv.writer writes
# them (its default line terminator is \r\n).
STEP_ROW_FORMAT = ",".join(["%d", "%d", "%s", "%s"] + ["%d"] * 8 + ["%r"] + ["%d"] * 4) + "\r\n"


class DecodeStepRows:
    """Writes the ``steps.csv`` rows of a decode jump's steps (decode-only, no prefill, no KV
    movement) in one call, the rows ``csv.writer`` would write for them one by one.

    To a file, the columns that are the same in every row of a jump are written into the row
    format once per jump, and each ``kv_usage`` text is made once per block count (a run
    holds the same few counts for many steps): per row only the step number, the times, the
    blocks in use and, past finishes, the batch and running sizes are formatted (half the
    cost of formatting all 17 fields). An in-memory sink (tests) gets the same rows as
    tuples."""

    def __init__(self, sink: CsvSink, replica_id: int, num_gpu_blocks: int) -> None:
        self.sink = sink
        self.replica_id = replica_id
        self.num_gpu_blocks = num_gpu_blocks
        # kv_usage's text per block count, made on first use (``usage_text[used]``).
        self.usage_text = _UsageTexts(num_gpu_blocks)
        self._formats: dict[tuple[int, int, int, int], str] = {}

    def write(self, first_id: int, starts: list[float], durations: list[float],
              batch: int | list[int], waiting: int, running: int | list[int], swapped: int,
              used: list[int]) -> None:
        """Steps ``first_id, first_id + 1, ...`` starting at ``starts`` and lasting
        ``durations``; ``batch`` rows each (decoding, sampling), ``running`` requests in the
        running set (per step, or the same for all), ``used`` blocks in use after each."""
        ids = range(first_id, first_id + len(durations))
        rid = self.replica_id
        if not self.sink.to_file:
            rows = repeat(batch) if isinstance(batch, int) else batch
            runs = repeat(running) if isinstance(running, int) else running
            self.sink.write_many(zip(
                ids, repeat(rid), map(repr, starts), map(repr, durations), rows, repeat(0),
                rows, rows, repeat(waiting), runs, repeat(swapped), used,
                map(round, map(truediv, used, repeat(self.num_gpu_blocks)), repeat(6)),
                repeat(0), repeat(0), repeat(0), repeat(0)))
            return
        tail = "%d,%s,0,0,0,0\r\n"  # kv_blocks_used, kv_usage, nothing recomputed or moved
        times = (map(repr, starts), map(repr, durations))
        if isinstance(batch, int) and isinstance(running, int):
            key = (batch, waiting, running, swapped)
            fmt = self._formats.get(key)  # consecutive jumps mostly share these columns
            if fmt is None:
                fmt = self._formats[key] = (
                    f"%d,{rid},%s,%s,{batch},0,{batch},{batch},{waiting},{running},{swapped},"
                    + tail)
            args = zip(ids, *times, used, map(self.usage_text.__getitem__, used))
        else:
            rows = [batch] * len(durations) if isinstance(batch, int) else batch
            runs = [running] * len(durations) if isinstance(running, int) else running
            fmt = f"%d,{rid},%s,%s,%d,0,%d,%d,{waiting},%d,{swapped}," + tail
            args = zip(ids, *times, rows, rows, rows, runs, used,
                       map(self.usage_text.__getitem__, used))
        self.sink.write_text("".join(map(fmt.__mod__, args)))

    def write_step(self, step_id: int, start: float, duration: float, batch: int, waiting: int,
                   running: int, used: int) -> None:
        """``write`` of one step with nothing swapped, without its per-call set-up."""
        if not self.sink.to_file:
            self.write(step_id, [start], [duration], batch, waiting, running, 0, [used])
            return
        self.sink.write_text(_ONE_DECODE_ROW % (
            step_id, self.replica_id, start, duration, batch, batch, batch, waiting, running,
            used, self.usage_text[used]))


# One decode-only row: DecodeStepRows.write's row with every column filled in per call.
_ONE_DECODE_ROW = "%d,%d,%r,%r,%d,0,%d,%d,%d,%d,0,%d,%s,0,0,0,0\r\n"


class _UsageTexts(dict):
    """Block count -> the kv_usage text of a steps.csv row (``repr`` of the rounded
    fraction), each made once."""

    def __init__(self, num_gpu_blocks: int) -> None:
        super().__init__()
        self.num_gpu_blocks = num_gpu_blocks

    def __missing__(self, used: int) -> str:
        text = self[used] = repr(round(used / self.num_gpu_blocks, 6))
        return text


def _fmt(x: float | None) -> str:
    return "" if x is None else repr(float(x))


PARTIAL = ".partial"  # the suffix of an output file still being written


def strict_json(value: Any) -> Any:
    """``value`` with every float that JSON cannot carry (NaN, infinities) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def interrupted_summary(summary: dict[str, Any], reason: BaseException) -> dict[str, Any]:
    """A summary of the figures so far of a run a signal stopped (``sim.errors.RunInterrupted``:
    its message names the signal)."""
    return {**summary, "status": "interrupted", "interrupted_by": str(reason)}


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: to a temporary name first, renamed when written."""
    partial = path.with_name(path.name + PARTIAL)
    partial.write_text(text)
    os.replace(partial, path)


class CsvSink:
    """Writes rows to a CSV file, or keeps them in memory when ``path`` is None (tests)."""

    enabled = True

    def __init__(self, path: Path | None, columns: tuple[str, ...]) -> None:
        self.columns = columns
        self.rows: list[tuple] | None = None
        self._file: IO[str] | None = None
        if path is None:
            self.rows = []
            self._write = self.rows.append
            self._write_many = self.rows.extend
        else:
            # Written under a temporary name, renamed when closed complete (``close``).
            self.path = path
            self._partial = path.with_name(path.name + PARTIAL)
            self._file = self._partial.open("w", newline="")
            w = csv.writer(self._file)
            w.writerow(columns)
            self._write = w.writerow
            self._write_many = w.writerows

    def write(self, row: tuple) -> None:
        self._write(row)

    def write_request(self, req: Request) -> None:
        """Write ``req``'s ``requests.csv`` row: to a file, a finished request's line is
        formatted in one pass (``finished_request_line``); otherwise ``request_row``."""
        if self._file is not None:
            line = finished_request_line(req)
            if line is not None:
                self._file.write(line)
                return
        self._write(request_row(req))

    def write_formatted(self, row: tuple, fmt: str) -> None:
        """Write one row. ``fmt``: a %-format of the whole row, ``\r\n`` included, giving the
        text ``csv.writer`` writes for it (numbers and strings that need no quoting only); to
        a file the row is formatted with it in one pass, faster than the writer's per-field
        calls."""
        if self._file is not None:
            self._file.write(fmt % row)
        else:
            self._write(row)

    def write_many(self, rows: Iterable[tuple]) -> None:
        """Write many rows in one call (a decode jump's steps, to memory; to a file
        ``DecodeStepRows`` formats them itself)."""
        self._write_many(rows)

    @property
    def to_file(self) -> bool:
        """Rows go to a file (not kept in memory)."""
        return self._file is not None

    def write_text(self, text: str) -> None:
        """Rows already formatted as ``csv.writer`` would write them (to a file only)."""
        if self._file is None:
            raise ValueError("write_text needs a file-backed sink")
        self._file.write(text)

    def close(self, complete: bool = True) -> None:
        """Close the file. ``complete``: it takes its name (rows up to here are whole);
        otherwise it keeps its ``.partial`` name, so no file that looks complete is left."""
        if self._file is not None:
            self._file.close()
            self._file = None
            if complete:
                os.replace(self._partial, self.path)


class NullSink(CsvSink):
    """Drops rows (``record_steps=false``: million-request runs need no per-step table)."""

    enabled = False

    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = columns
        self.rows = None
        self._file = None

    def write(self, row: tuple) -> None:
        pass

    def write_request(self, req: Request) -> None:
        pass

    def write_formatted(self, row: tuple, fmt: str) -> None:
        pass

    def write_many(self, rows: Iterable[tuple]) -> None:
        pass


def request_row(req: Request) -> tuple:
    arrival, scheduled = req.arrival_time, req.first_scheduled_time
    first, finish = req.first_token_time, req.finish_time
    tokens = "" if req.output_token_ids is None else " ".join(map(str, req.output_token_ids))
    return (
        req.request_id, req.replica_id, req.status.name.lower(), req.reject_reason or "",
        req.priority, repr(arrival), req.prompt_len, req.max_output_len,
        req.num_output_tokens, _fmt(scheduled), _fmt(first), _fmt(finish),
        "" if scheduled is None else repr(scheduled - arrival),
        "" if first is None else repr(first - arrival), _fmt(req.tpot),
        "" if finish is None else repr(finish - arrival), req.num_preemptions, req.num_swaps,
        req.num_recomputes, req.num_cached_tokens, tokens,
    )


# The requests.csv line of a finished request as csv.writer writes ``request_row``'s tuple:
# ``%d`` and ``%s`` write what the writer's str() does for the integer columns, ``%r`` the
# same repr() request_row applies to the time columns, and no field needs quoting (integer
# ids, no reject reason, times and space-separated token ids only).
FINISHED_REQUEST_LINE = "%d,%d,finished,,%d,%r,%s,%s,%s,%r,%r,%r,%r,%r,%s,%r,%s,%s,%s,%s,%s\r\n"
_FINISHED = RequestStatus.FINISHED


def finished_request_line(req: Request) -> str | None:
    """The text ``csv.writer`` writes for ``request_row(req)``, ``\r\n`` included, made
    without the row tuple and the writer's per-field calls. None (use ``request_row``) unless
    ``req`` is a finished request outside a decode run, with plain int request id, replica id
    and priority and no reject reason."""
    if (req.status is not _FINISHED or req._run is not None or req.reject_reason is not None
            or type(req.request_id) is not int or type(req.replica_id) is not int
            or type(req.priority) is not int):
        return None
    # Outside a run the counters and token times are the plain fields (see sim/request.py).
    arrival, scheduled = req.arrival_time, req.first_scheduled_time
    first, finish, n = req._first_token, req.finish_time, req._outputs
    if scheduled is None or first is None or finish is None:
        return None
    ids = req.output_token_ids
    return FINISHED_REQUEST_LINE % (
        req.request_id, req.replica_id, req.priority, arrival, req.prompt_len,
        req.max_output_len, n, float(scheduled), float(first), float(finish),
        scheduled - arrival, first - arrival,
        repr(float((req._last_token - first) / (n - 1))) if n >= 2 else "",
        finish - arrival, req.num_preemptions, req.num_swaps, req.num_recomputes,
        req.num_cached_tokens, "" if ids is None else " ".join(map(str, ids)),
    )
