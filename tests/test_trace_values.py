"""Trace rows with NaN, infinity or a JSON bool where a number belongs are refused with
TraceFormatError naming the file and line (a NaN timestamp used to be accepted and fill the
summary with NaN; a NaN or infinite token count raised a bare ValueError / OverflowError)."""

from __future__ import annotations

import pytest

from workloads import make_workload
from workloads.trace import TraceFormatError

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("row,match", [
    ("nan,10,5", r":3: TIMESTAMP must be a finite number, got 'nan'"),
    ("inf,10,5", r":3: TIMESTAMP must be a finite number, got 'inf'"),
    ("-inf,10,5", r":3: TIMESTAMP must be a finite number, got '-inf'"),
    ("1,nan,5", r":3: ContextTokens must be a finite number, got 'nan'"),
    ("1,inf,5", r":3: ContextTokens must be a finite number, got 'inf'"),
    ("1,10,NaN", r":3: GeneratedTokens must be a finite number, got 'NaN'"),
    ("1,10,Infinity", r":3: GeneratedTokens must be a finite number, got 'Infinity'"),
])
def test_azure_row_with_a_non_finite_value_names_file_and_line(tmp_path, row, match):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0,10,5\n" + row + "\n2,10,5\n")
    with pytest.raises(TraceFormatError, match=match) as e:
        make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert e.value.field == "workload.path"
    assert str(e.value).startswith(f"workload.path: {p}:3: ")


@pytest.mark.parametrize("record,match", [
    ('"timestamp": NaN, "input_length": 10, "output_length": 5',
     r":2: timestamp must be a finite number, got nan"),
    ('"timestamp": Infinity, "input_length": 10, "output_length": 5',
     r":2: timestamp must be a finite number, got inf"),
    ('"timestamp": -Infinity, "input_length": 10, "output_length": 5',
     r":2: timestamp must be a finite number, got -inf"),
    ('"timestamp": 5, "input_length": NaN, "output_length": 5',
     r":2: input_length must be a finite number, got nan"),
    ('"timestamp": 5, "input_length": 10, "output_length": Infinity',
     r":2: output_length must be a finite number, got inf"),
    ('"timestamp": true, "input_length": 10, "output_length": 5',
     r":2: timestamp True is not a number"),
    ('"timestamp": 5, "input_length": true, "output_length": 5',
     r":2: input_length True is not a number"),
    ('"timestamp": "abc", "input_length": 10, "output_length": 5',
     r":2: timestamp 'abc' is not a number"),
])
def test_mooncake_record_with_a_non_finite_value_names_file_and_line(tmp_path, record, match):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n{' + record + "}\n")
    with pytest.raises(TraceFormatError, match=match) as e:
        make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert str(e.value).startswith(f"workload.path: {p}:2: ")


def test_finite_rows_still_replay(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1000, "input_length": 10, "output_length": 5}\n'
                 '{"timestamp": "3000", "input_length": 1e1, "output_length": 0}\n')
    w = make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert [(r.arrival_time, r.prompt_len, r.max_output_len) for r in w] == [(0.0, 10, 5),
                                                                            (2.0, 10, 1)]


def test_azure_rows_must_have_as_many_cells_as_the_header(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0,10,5\n1,10,5,7\n")
    with pytest.raises(TraceFormatError, match=r":3: expected 3 columns \(as the header\), got 4"):
        make_workload({"name": "trace", "path": str(p)}, seed=0)
    p.write_text(HEADER + "0,10,5\n1,10\n")
    with pytest.raises(TraceFormatError, match=r":3: expected 3 columns \(as the header\), got 2"):
        make_workload({"name": "trace", "path": str(p)}, seed=0)
    # A trailing comma is an empty cell, not a column.
    p.write_text(HEADER + "0,10,5,\n1,10,5, ,\n")
    assert len(list(make_workload({"name": "trace", "path": str(p)}, seed=0))) == 2
    # Columns after the three are the file's own: allowed, row by row.
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Model\n0,10,5,a\n1,12,0,b\n")
    w = make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert [(r.prompt_len, r.max_output_len) for r in w] == [(10, 5), (12, 1)]


@pytest.mark.parametrize("name", ["t.json", "t.txt", "t"])
def test_a_mooncake_trace_is_read_by_content_whatever_its_suffix(tmp_path, name):
    p = tmp_path / name
    p.write_text('\n{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                 '{"timestamp": 500, "input_length": 20, "output_length": 3}\n')
    w = make_workload({"name": "trace", "path": str(p)}, seed=0)
    assert [(r.arrival_time, r.prompt_len) for r in w] == [(0.0, 10), (0.5, 20)]
    azure = tmp_path / ("a" + name)  # and a CSV named like JSON is still a CSV
    azure.write_text(HEADER + "0,10,5\n")
    assert [r.prompt_len for r in make_workload({"name": "trace", "path": str(azure)}, 0)] == [10]


def test_a_mooncake_record_missing_a_length_says_which(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                 '{"timestamp": 5, "output_length": 5}\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: missing 'input_length'"):
        make_workload({"name": "trace", "path": str(p)}, seed=0)


def test_a_damaged_jsonl_trace_gets_the_json_readers_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('[{"timestamp": 0, "input_length": 10, "output_length": 5}]\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:1: not a Mooncake record"):
        make_workload({"name": "trace", "path": str(p)}, seed=0)
