"""The notebooks run top to bottom, headless, in a fresh kernel of this Python; their asserts pass.

Each notebook runs in a kernel started from a kernelspec that points at this interpreter
(``sys.executable``, the venv's Python), with a private IPython directory (ipyparallel's
cluster files) and Jupyter runtime directory. All but the planning notebook start MPI
engines, which ipyparallel runs in sessions of their own: every process the kernel starts
inherits a tag in its environment, and whatever still carries the tag after the run (also
after a failure) is stopped, so the test never leaves processes behind or hangs on them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from jobs import launcher_environment

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
for _module in ("ipykernel", "ipyparallel", "matplotlib"):
    pytest.importorskip(_module)

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_planning.ipynb",
    "03_training.ipynb",
    "04_transformer.ipynb",
)
NEEDS_FLAX = ("03_training.ipynb", "04_transformer.ipynb")  # train with flax and optax
# Pictures that display inline: layouts and plans; the loss plot; plans and the loss plot.
MIN_IMAGES = {"02_planning.ipynb": 5, "03_training.ipynb": 1, "04_transformer.ipynb": 4}
CELL_TIMEOUT = 300  # seconds per cell
KERNEL_STARTUP_TIMEOUT = 120  # seconds
TAG_VARIABLE = "OSMM_NOTEBOOK_RUN"
EXIT_GRACE = 30  # seconds for the kernel's processes to exit after a successful run


def _tagged_processes(tag: str) -> list[int]:
    """Ids of the live processes whose environment carries ``TAG_VARIABLE=tag`` (Linux /proc)."""
    if not Path("/proc").is_dir():  # not Linux: nothing to find
        return []
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _wait_for_exit(tag: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _stop(pids: list[int], tag: str) -> None:
    """SIGTERM, then SIGKILL what is still there after 10 s; only processes carrying ``tag``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        pids = _wait_for_exit(tag, 10)
        if not pids:
            return


@pytest.fixture
def kernel_environment(tmp_path, monkeypatch):
    """A ``python3`` kernelspec for this interpreter, private Jupyter/IPython dirs, a process tag.

    Yields the tag. Afterwards, every process still carrying it is stopped.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    # JUPYTER_PATH comes before the user's and the system's kernelspecs.
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    for name, value in launcher_environment().items():
        monkeypatch.setenv(name, value)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    try:
        yield tag
    finally:
        left = _tagged_processes(tag)
        if left:
            _stop(left, tag)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, kernel_environment):
    if name in NEEDS_FLAX:
        pytest.importorskip("osmm_jax.flax", exc_type=ImportError)
        pytest.importorskip("optax")
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        startup_timeout=KERNEL_STARTUP_TIMEOUT,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= MIN_IMAGES.get(name, 0), len(images)
    left = _wait_for_exit(kernel_environment, EXIT_GRACE)
    assert not left, f"processes the notebook started are still running: {left}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
