"""Run code in a fresh Python interpreter and say which of some modules it loaded: how the tests
check that planning and plotting load neither JAX nor MPI (nor matplotlib before a picture)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable


def modules_loaded_by(code: str, modules: Iterable[str]) -> list[str]:
    """The names of ``modules`` loaded once ``code`` has run in a new interpreter (asserting that
    it ran without error)."""
    report = f"\nimport sys\nprint([m for m in {tuple(modules)!r} if m in sys.modules])\n"
    result = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.splitlines()[-1])
