"""Suite-wide settings.

The suite runs one process per core (pytest-xdist, pyproject addopts); a BLAS thread pool in
each would only contend for the same cores (numpy's OpenBLAS gains nothing from a second
thread on these workloads and spends twice the CPU), so each process, and the servers and
commands the tests start, computes on one thread. Set here, before the workers start and
import numpy."""

import os

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
