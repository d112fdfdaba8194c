"""``python -m experiments.serve`` started as a separate process on a free port of 127.0.0.1
and stopped as a user stops it (SIGINT), so the caller (a load-generator run, a test) can
read what the server wrote."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    out_dir: Path
    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)
    returncode: int | None = None

    def summary(self) -> dict:
        return json.loads((self.out_dir / "summary.json").read_text())

    def requests(self) -> dict[int, dict[str, str]]:
        with (self.out_dir / "requests.csv").open() as f:
            return {int(r["request_id"]): r for r in csv.DictReader(f)}


@contextmanager
def serving(out_dir: Path, *overrides: str, startup_s: float = 60.0,
            cpus: set[int] | None = None) -> Iterator[Served]:
    """The server with these Hydra overrides, its outputs in ``out_dir``; stopped by SIGINT
    on exit (its exit code in ``Served.returncode``, its output lines in ``Served.output``).
    ``cpus``: the cores it may run on (Linux; None: any)."""
    port = free_port()
    cmd = [sys.executable, "-m", "experiments.serve", f"serve.port={port}",
           f"hydra.run.dir={out_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if cpus is not None:  # pinned before it has finished importing, long before it serves
        os.sched_setaffinity(proc.pid, cpus)
    served = Served(f"http://127.0.0.1:{port}", out_dir, proc)
    deadline = time.monotonic() + startup_s
    assert proc.stdout is not None
    for line in proc.stdout:
        served.output.append(line.rstrip("\n"))
        if line.startswith("serving "):
            break
        if time.monotonic() > deadline:
            break
    else:
        proc.wait()
        raise AssertionError("the server did not start:\n" + "\n".join(served.output))
    try:
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        served.output.extend(rest.splitlines())
        served.returncode = proc.returncode
