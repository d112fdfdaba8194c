"""Progress bars: drawn on stderr by tqdm after a delay, never when turned off."""

from __future__ import annotations

from sim.progress import Progress, job_bar
from tests.helpers import small_cfg


def test_a_run_bar_counts_requests_and_shows_the_simulated_time(capsys):
    bar = Progress(200, enabled=True, delay_s=0.0)
    bar.update(50, 12.0)
    bar.update(120, 1234.0)
    bar._bar.refresh()
    text = capsys.readouterr().err
    assert "120/200" in text and "sim 1,234 s" in text
    bar.close()


def test_turned_off_or_quick_nothing_is_drawn(capsys):
    for enabled, delay in ((False, 0.0), (True, 60.0)):
        bar = Progress(10, enabled=enabled, delay_s=delay)
        bar.update(10, 1.0)
        bar.close()
    with job_bar(3, enabled=False) as jobs:
        jobs.update(3)
    assert capsys.readouterr().err == ""


def test_a_job_bar_counts_jobs(capsys):
    with job_bar(4, desc="runs", delay_s=0.0) as bar:
        bar.update(1)
        bar.update(1)
        bar.refresh()
        text = capsys.readouterr().err
        assert "runs" in text and "2/4" in text


def test_a_run_with_progress_off_writes_nothing_to_stderr(capfd):
    from experiments.simulation import Simulation

    Simulation({**small_cfg(), "progress": False}, None).run()
    assert capfd.readouterr().err == ""
