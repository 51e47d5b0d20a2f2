"""Entry point for one MPI test run: ``mpiexec -n N python tests/mpi/run.py [pytest args]``.

Rank 0 prints pytest's report (which carries every rank's failures, see
conftest.py); the other ranks stay quiet. The exit status is non-zero on every
rank if any test failed on any rank.
"""

import os
import sys

import pytest
from mpi4py import MPI

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
args = sys.argv[1:]
if rank != 0:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    args += ["-p", "no:cacheprovider"]
else:
    print(f"==== MPI tests on {size} rank(s) ====", flush=True)
code = pytest.main(args)
sys.exit(code)
