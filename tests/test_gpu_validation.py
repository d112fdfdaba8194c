"""experiments/gpu_validation.py: the GPU validation as one command within a budget. On a CPU
the validation itself runs with the tiny model (as tests/test_validate_gpu.py runs the preset);
the kernel table needs CUDA and reports its failure."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from experiments import gpu_validation as gv
from tests.test_validate import SMALL_GRID

# conf/validate_gpu.yaml on a CPU with tiny counts (tests/test_validate_gpu.py).
ON_CPU = ("device=cpu", "model=tiny", "executor.timer=cpu", "executor.kernels=torch",
          "executor.dtype=fp32", "validate.saturation_num_gpu_blocks=512", *SMALL_GRID)
CPU = (*ON_CPU, "workload.num_requests=40", "validate.real_repeats=2",
       "validate.calibration_runs=1")
# Fewer requests and runs where a validation only has to finish as one part among the others
# (tests/test_validate_gpu.py checks the preset's own runs, probes and folders): every stage
# still runs, the saturation probes, the interleaved profile, a real run, the fit, the
# simulated run and the replay.
CPU_QUICK = (*ON_CPU, "workload.num_requests=12", "validate.real_repeats=1",
             "validate.calibration_runs=0")


def _progress(out: Path) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in (out / "progress.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| part", "|---"))]
    return {r[0].lstrip("| "): [c.strip(" |") for c in r[1:]] for r in rows}


def test_a_part_without_enough_time_left_is_not_started(tmp_path: Path) -> None:
    rc = gv.main(["--out", str(tmp_path / "out"), "--budget", "5", "--min-part", "30",
                  "--parts", "fcfs,sjf", "--work", str(tmp_path / "work")])
    assert rc == 1
    progress = _progress(tmp_path / "out")
    assert list(progress) == ["fcfs", "sjf"]
    for state, _seconds, note in progress.values():
        assert state == "not started" and "less than --min-part 30" in note
    assert not (tmp_path / "out" / "table.md").exists()
    assert (tmp_path / "out" / "log.txt").exists()


def test_bad_arguments_are_refused(tmp_path: Path, capsys) -> None:
    for args in (["--budget", "0"], ["--wheels", str(tmp_path / "none")],
                 ["--parts", "nosuch"]):
        with pytest.raises(SystemExit) as e:
            gv.main(["--out", str(tmp_path / "out"), *args])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--budget must be > 0" in err and "is not a folder" in err and "nosuch" in err


@pytest.mark.slow
def test_install_from_a_folder_of_wheels_without_an_index(tmp_path: Path, monkeypatch) -> None:
    """A package the parts need is missing: its wheel is installed from --wheels into a folder
    of its own, which the later parts find first on their path."""
    pkg = tmp_path / "pkg"
    (pkg / "llmserve_probe_mod").mkdir(parents=True)
    (pkg / "llmserve_probe_mod" / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "pyproject.toml").write_text(
        '[project]\nname = "llmserve-probe-mod"\nversion = "1.0"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n')
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(wheels), str(pkg)],
                   check=True, capture_output=True)
    monkeypatch.setattr(gv, "NEEDED_MODULES", ("numpy", "llmserve_probe_mod"))
    site = tmp_path / "site"
    out = tmp_path / "out"
    rc = gv.main(["--out", str(out), "--parts", "install", "--wheels", str(wheels),
                  "--site", str(site), "--work", str(tmp_path / "work")])
    assert rc == 0, (out / "log.txt").read_text()
    state, _seconds, note = _progress(out)["install"]
    assert state == "done" and note == "missing: llmserve_probe_mod"
    probe = subprocess.run([sys.executable, "-c", "import llmserve_probe_mod as m; print(m.VALUE)"],
                           env={"PYTHONPATH": str(site)}, capture_output=True, text=True,
                           check=True)
    assert probe.stdout.strip() == "7"


def test_install_with_nothing_missing_does_nothing(tmp_path: Path) -> None:
    assert gv.missing_modules() == []  # the test environment has every package
    rc = gv.main(["--out", str(tmp_path), "--parts", "install", "--work", str(tmp_path / "w")])
    assert rc == 0 and _progress(tmp_path)["install"][0::2] == ["done", "nothing missing"]


@pytest.mark.slow
def test_one_command_runs_the_validation_and_writes_each_part_as_it_finishes(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out, work = tmp_path / "out", tmp_path / "work"
    rc = gv.main(["--out", str(out), "--work", str(work), "--budget", "400", "--min-part", "1",
                  "--parts", "install,gpu_check,fcfs", "--requests", "5", *CPU_QUICK])
    progress = _progress(out)
    assert list(progress) == ["install", "gpu_check", "fcfs"]
    assert progress["install"][0] == "done"
    # The kernel table needs CUDA: on a CPU it says so and the validation still runs.
    assert progress["gpu_check"][0] == "failed (exit 1)"
    assert "no CUDA device" in (out / "log.txt").read_text()
    assert progress["fcfs"][0] == "done", (out / "log.txt").read_text()[-3000:]
    assert rc == 1  # one part failed
    table = (out / "table.md").read_text()
    assert "fcfs at " in table and "not finished" not in table
    with tarfile.open(out / "runs.tar.gz") as tar:
        assert "fcfs/validation.json" in tar.getnames()
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "progress.md", "runs.tar.gz",
                                                     "table.md"]


@pytest.mark.slow
def test_a_part_that_outruns_the_budget_is_stopped_and_reported(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    rc = gv.main(["--out", str(out), "--work", str(tmp_path / "work"), "--budget", "4",
                  "--min-part", "0", "--parts", "fcfs", *CPU])
    assert rc == 1
    assert _progress(out)["fcfs"][0] == "stopped at the budget"
    assert "fcfs: not finished" in (out / "table.md").read_text()
    assert (out / "runs.tar.gz").exists()
