"""examples/train_mlp.py, run in-process for a few steps on the current ranks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

pytest.importorskip("osmm_jax.flax", exc_type=ImportError)
import flax.linen as nn  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# Nothing checked here changes from three ranks to four (uneven splits and a rank with nothing
# appear from 3 on); the 4-rank run is for the 2x2 grids, the notified reduce's origin rounds and
# the tensor-parallel replica groups.
pytestmark = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


@pytest.fixture(scope="module")
def train_mlp():
    spec = importlib.util.spec_from_file_location("train_mlp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (the Flax modules) look their module up
    spec.loader.exec_module(module)
    return module


def _speeds() -> str:
    return ",".join(str(1 + r % 3) for r in range(SIZE))  # uneven: 1, 2, 3, 1, ...


def test_training_matches_single_process(train_mlp):
    argv = ["--steps", "3", "--batch", str(7 * SIZE + 1), "--speeds", _speeds()]
    assert train_mlp.main(argv) == 0


@pytest.mark.ranks(min=2, reason="one rank's gradient is the global one")
def test_a_mismatch_is_reported(train_mlp, monkeypatch):
    """Stock layers on each rank's shard alone (no summed gradients) must fail the check."""

    class Dense(nn.Dense):  # named like the stock layer, so the parameter names match
        row_sizes: tuple | None = None
        method: str | None = None

    monkeypatch.setattr(train_mlp, "Dense", Dense)
    argv = ["--steps", "2", "--batch", str(4 * SIZE), "--speeds", _speeds()]
    assert train_mlp.main(argv + ["--method", "one_sided"]) == 1


def test_bad_arguments_stop_every_rank(train_mlp):
    with pytest.raises(SystemExit):
        train_mlp.main(["--speeds", ",".join(["1"] * (SIZE + 1))])
