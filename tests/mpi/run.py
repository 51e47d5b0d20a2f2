"""Entry point for one MPI test run: ``mpiexec -n N python tests/mpi/run.py [pytest args]``.

Rank 0 prints pytest's report (which carries every rank's failures, see
conftest.py). The other ranks write theirs to ``$OSMM_TEST_LOG_DIR/rank<r>.log``
(default ``build/mpi-logs``, emptied by each run): a rank that dies alone (a
pytest timeout dumps its threads' stacks and exits) leaves its last words there,
and ``make test-mpi`` prints their ends when a run fails. The exit status is
non-zero on every rank if any test failed on any rank.
"""

import os
import sys

import pytest
from mpi4py import MPI

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
args = sys.argv[1:]
log_dir = os.environ.get("OSMM_TEST_LOG_DIR", os.path.join("build", "mpi-logs"))
if rank == 0:
    os.makedirs(log_dir, exist_ok=True)
    for name in os.listdir(log_dir):
        if name.startswith("rank") and name.endswith(".log"):
            os.remove(os.path.join(log_dir, name))
    print(f"==== MPI tests on {size} rank(s) ====", flush=True)
MPI.COMM_WORLD.Barrier()  # the old logs are gone before any rank writes its own
if rank != 0:
    # Line-buffered, for the life of the process: what a rank wrote survives its os._exit.
    sys.stdout = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    args += ["-p", "no:cacheprovider"]
code = pytest.main(args)
sys.exit(code)
