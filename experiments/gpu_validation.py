"""The whole GPU validation as one command within a time budget, installs included: the kernel
table first, then the calibrated simulator against the real executor, one configuration after
another, each part's results written as it finishes (docs/gpu-validation.md).

    python -m experiments.gpu_validation --out gpu_results                 # 540 s in all
    python -m experiments.gpu_validation --out r --wheels wheelhouse       # no network there
    python -m experiments.gpu_validation --out r --parts chunked_prefill,sjf

Parts, in order (``PARTS``): ``install`` (only if a package the others need is missing: the
wheels of ``--wheels`` into a folder of their own, else ``pip install -e ".[real]"``),
``gpu_check`` (``experiments/gpu_check.py``), then ``experiments.validate --config-name
validate_gpu`` for ``fcfs``, ``preempt`` (fcfs on a pool of 384 blocks), ``chunked_prefill``
and ``sjf``. Each part is a child process given the time left of the budget, counted from this
command's start; a part that would start with less than ``--min-part`` seconds left is not
started. ``--out`` gets these files, each written whole once there is something to write and
rewritten after every part:

- ``progress.md``: each part's state (done, failed with its exit code, stopped at the budget,
  not started) and its seconds;
- ``gpu_check.md``: the kernel table (once ``gpu_check`` has finished on a GPU);
- ``table.md``: ``experiments.validate.summary_table`` over the validations run so far (from
  the first one on);
- ``runs.tar.gz``: their Hydra folders (likewise);
- ``log.txt``: every part's output.

This module imports only the standard library: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages the parts import (module names), checked before anything runs.
NEEDED_MODULES = ("simpy", "numpy", "scipy", "pandas", "hydra", "omegaconf", "plotly", "tqdm",
                  "torch", "triton")
VALIDATIONS: dict[str, tuple[str, ...]] = {
    "fcfs": (),
    "preempt": ("kv.num_gpu_blocks_override=384",),
    "chunked_prefill": ("policy=chunked_prefill",),
    "sjf": ("policy=sjf",),
}
PARTS = ("install", "gpu_check", *VALIDATIONS)
# Seconds a child is given to write its table (summary_table reads two small files per run).
TABLE_TIMEOUT_S = 60


@dataclass
class Part:
    name: str
    state: str = "not started"
    seconds: float = 0.0
    note: str = ""


@dataclass
class Runner:
    """One command's parts, budget and files."""

    out: Path
    work: Path
    budget_s: float
    min_part_s: float
    started: float = field(default_factory=time.monotonic)
    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "PYTHONUNBUFFERED": "1"})
    parts: list[Part] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def log(self, text: str) -> None:
        with open(self.out / "log.txt", "a", encoding="utf-8") as f:
            f.write(text)

    def run(self, part: Part, cmd: Sequence[str]) -> None:
        """Run ``cmd`` for ``part`` with the time left, its output appended to log.txt."""
        left = self.left()
        if left < self.min_part_s:
            part.note = f"{left:.0f} s left, less than --min-part {self.min_part_s:g}"
            return
        self.log(f"\n$ {' '.join(cmd)}\n")
        t0 = time.monotonic()
        with open(self.out / "log.txt", "a", encoding="utf-8") as log:
            try:
                rc = subprocess.run(cmd, check=False, cwd=ROOT, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=left).returncode
                part.state = "done" if rc == 0 else f"failed (exit {rc})"
            except subprocess.TimeoutExpired:
                part.state = "stopped at the budget"
        part.seconds = time.monotonic() - t0

    def write_progress(self) -> None:
        lines = ["| part | state | seconds | note |", "|---|---|---|---|"]
        lines += [f"| {p.name} | {p.state} | {p.seconds:.0f} | {p.note} |" for p in self.parts]
        spent = time.monotonic() - self.started
        lines += ["", f"{spent:.0f} s of the {self.budget_s:g} s budget spent."]
        _write(self.out / "progress.md", "\n".join(lines) + "\n")


def _write(path: Path, text: str) -> None:
    """Write whole or not at all: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def missing_modules() -> list[str]:
    return [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]


def install(runner: Runner, part: Part, wheels: Path | None, site: Path) -> None:
    """Install what is missing: the wheels of ``wheels`` (no index, no dependency resolution:
    the folder holds every wheel needed) into ``site``, put first on the children's path; or
    the project's ``real`` extra from the package index."""
    missing = missing_modules()
    if not missing:
        part.state, part.note = "done", "nothing missing"
        return
    part.note = "missing: " + ", ".join(missing)
    if wheels is not None:
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        if not files:
            part.state = "failed (no wheels)"
            part.note += f"; {wheels} holds no .whl file"
            return
        runner.run(part, [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--upgrade", "--target", str(site),
                           *files])
        path = runner.env.get("PYTHONPATH")
        runner.env["PYTHONPATH"] = str(site) + (os.pathsep + path if path else "")
    else:
        runner.run(part, [sys.executable, "-m", "pip", "install", "-q", "-e", ".[real]"])


def write_tables(runner: Runner, finished: list[str]) -> None:
    """table.md over the validations so far, and their folders into runs.tar.gz."""
    folders = [str(runner.work / name) for name in finished]
    code = ("import sys; from experiments.validate import summary_table; "
            "print(summary_table(sys.argv[1:]))")
    try:
        res = subprocess.run([sys.executable, "-c", code, *folders], check=False, cwd=ROOT,
                             env=runner.env, capture_output=True, text=True,
                             timeout=TABLE_TIMEOUT_S)
        text = res.stdout if res.returncode == 0 else f"summary_table failed:\n{res.stderr}"
    except subprocess.TimeoutExpired:
        text = f"summary_table took more than {TABLE_TIMEOUT_S} s"
    _write(runner.out / "table.md", "```\n" + text.rstrip("\n") + "\n```\n")
    tmp = runner.out / "runs.tar.gz.partial"
    with tarfile.open(tmp, "w:gz") as tar:
        for name in finished:
            if (runner.work / name).exists():
                tar.add(runner.work / name, arcname=name)
    tmp.replace(runner.out / "runs.tar.gz")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path, required=True, help="the folder for the results")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for everything, installs included (default 540)")
    ap.add_argument("--min-part", type=float, default=60.0,
                    help="a part starts only with this many seconds left (default 60)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run, in this order: {','.join(PARTS)}")
    ap.add_argument("--wheels", type=Path, help="a folder of wheels to install from (no index)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/llmserve-site"),
                    help="where --wheels are installed")
    ap.add_argument("--work", type=Path,
                    help="the validations' Hydra folders (default: outputs/gpu_validation/<time>)")
    ap.add_argument("--requests", type=int, default=200, help="gpu_check's end-to-end requests")
    ap.add_argument("overrides", nargs="*",
                    help="key=value overrides for every validation (e.g. a smaller workload)")
    args = ap.parse_args(argv)
    if args.budget <= 0 or args.min_part < 0:
        ap.error("--budget must be > 0 and --min-part >= 0")
    chosen = args.parts.split(",")
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; the parts are {','.join(PARTS)}")
    if args.wheels is not None and not args.wheels.is_dir():
        ap.error(f"--wheels: {args.wheels} is not a folder")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or ROOT / "outputs" / "gpu_validation" / time.strftime("%Y-%m-%d_%H-%M-%S")
    work = work.resolve()
    runner = Runner(args.out.resolve(), work, args.budget, args.min_part)
    (runner.out / "log.txt").write_text("", encoding="utf-8")
    order = [p for p in PARTS if p in chosen]
    runner.parts = [Part(name) for name in order]
    runner.write_progress()
    finished: list[str] = []
    for part in runner.parts:
        if part.name == "install":
            install(runner, part, args.wheels, args.site.resolve())
        elif part.name == "gpu_check":
            runner.run(part, [sys.executable, "-m", "experiments.gpu_check", "--out",
                               str(runner.out / "gpu_check.md"),
                               "--requests", str(args.requests)])
        else:
            runner.run(part, [sys.executable, "-m", "experiments.validate", "--config-name",
                               "validate_gpu", *VALIDATIONS[part.name], *args.overrides,
                               f"hydra.run.dir={work / part.name}"])
            if part.state != "not started":
                finished.append(part.name)
                write_tables(runner, finished)
        runner.write_progress()
        note = f"; {part.note}" if part.note else ""
        print(f"{part.name}: {part.state} ({part.seconds:.0f} s){note}", flush=True)
    return 0 if all(p.state == "done" for p in runner.parts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
