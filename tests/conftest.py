"""Suite-wide settings.

The suite runs one process per core (pytest-xdist, pyproject addopts); a BLAS thread pool in
each would only contend for the same cores (numpy's OpenBLAS gains nothing from a second
thread on these workloads and spends twice the CPU), so each process, and the servers and
commands the tests start, computes on one thread. Set here, before the workers start and
import numpy."""

import os

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")


def pytest_ignore_collect(collection_path, config):
    """``-m equivalence`` (the fast-vs-exact subset): a test file that never names the marker
    holds none of its tests (no marker is added outside the files), so it is not collected
    and the workers do not import torch, triton and the online extras for nothing."""
    if (config.option.markexpr.strip() == "equivalence" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "equivalence" not in collection_path.read_text()
    return None
