"""The dtypes osmm_jax multiplies, and what each one implies: the package's one dtype table.

For every supported input dtype: the dtype its products and sums are formed in (float64 for
float64, float32 for the rest, so 16-bit partials travel as float32), and the largest relative
drift the checksum (``verify=True``) accepts (float32's is 1e-5; the others scale with the
dtype's rounding, since the result is rounded to the input dtype before it is checked).

Pure numpy (``ml_dtypes`` provides bfloat16): importable without JAX or MPI.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np


class DtypePolicy(NamedTuple):
    """What osmm_jax does with inputs of one dtype."""

    accumulation: np.dtype  # products and sums are formed in this dtype
    checksum_tolerance: float  # largest accepted relative drift under verify=True


_POLICIES = {
    np.dtype(np.float32): DtypePolicy(np.dtype(np.float32), 1e-5),
    np.dtype(np.float64): DtypePolicy(np.dtype(np.float64), 1e-12),
    np.dtype(ml_dtypes.bfloat16): DtypePolicy(np.dtype(np.float32), 8e-3),
    np.dtype(np.float16): DtypePolicy(np.dtype(np.float32), 1e-3),
}

SUPPORTED = tuple(_POLICIES)
"""The input dtypes :func:`osmm_jax.matmul` accepts, as numpy dtypes."""

NAMES = tuple(d.name for d in SUPPORTED)
"""Their names: ``("float32", "float64", "bfloat16", "float16")``."""


def is_supported(dtype) -> bool:
    """Whether ``dtype`` (anything ``np.dtype`` understands) is one osmm_jax multiplies."""
    try:
        return np.dtype(dtype) in _POLICIES
    except TypeError:
        return False


def policy(dtype) -> DtypePolicy:
    """The policy of a supported ``dtype``; ValueError naming the supported ones otherwise."""
    if not is_supported(dtype):
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(NAMES)}")
    return _POLICIES[np.dtype(dtype)]


def accumulation_dtype(dtype) -> np.dtype:
    """The dtype products of ``dtype`` inputs are summed in: float64 for float64, else float32."""
    return policy(dtype).accumulation


def checksum_tolerance(dtype) -> float:
    """The largest relative drift ``verify=True`` accepts for ``dtype`` inputs."""
    return policy(dtype).checksum_tolerance
