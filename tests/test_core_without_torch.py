"""The simulator core must import and run with torch and triton unavailable."""

import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'triton'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import sim, policies, workloads, executors
from executors.cost_model import RooflineCostModel
from tests.helpers import small_cfg
from experiments.simulation import run_simulation
s = run_simulation(small_cfg("workload.num_requests=10")).summary
assert s["completed"] == 10, s
assert not any(m.split('.')[0] in ('torch', 'triton') for m in sys.modules)
print("ok")
"""


def test_core_runs_without_torch_or_triton():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


REAL_WITHOUT_TORCH = r"""
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        top = name.split('.')[0]
        if top in ('torch', 'triton'):
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
sys.meta_path.insert(0, Block())
sys.argv = ["run", "executor=real", "model=tiny", "workload.num_requests=3",
            "hydra.run.dir=" + sys.argv[1]]
runpy.run_module("experiments.run", run_name="__main__")
"""


def test_the_real_executor_without_its_extra_is_a_config_error(tmp_path):
    p = subprocess.run([sys.executable, "-c", REAL_WITHOUT_TORCH, str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2
    line = ("config error: executor.name: executor 'real' needs 'torch', which is not "
            "installed (the optional 'real' extra: pip install -e '.[real]')")
    assert p.stderr.strip().splitlines() == [line]
