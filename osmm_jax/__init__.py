"""osmm_jax: one-sided distributed matrix multiplication for JAX over MPI.

Typical use, on every rank of an MPI job (SPMD)::

    import osmm_jax as om
    a = om.Layout.rows((M, K), weights=speeds)
    b = om.Layout.replicated((K, N))
    c = om.Layout.rows((M, N), weights=speeds)
    p = om.plan(a, b, c)
    c_local = om.matmul(a_local, b_local, p)   # eager, jit, grad, vmap

The public names load on first use: layouts and plans are pure Python and need
neither JAX nor MPI, so ``osmm_jax.Layout`` can be used on a laptop; the names
that run products initialise MPI (through mpi4py) when first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from osmm_jax._src.planning import layout as _layout

__version__ = "0.1.0"


def _comm_world_size() -> int:
    # Imported on the first call: layouts given a rank count never start MPI.
    from osmm_jax._src.runtime.api import default_nranks

    return default_nranks()


# A layout built with nranks=None is for every rank of COMM_WORLD; the pure layout module
# cannot ask MPI itself (see osmm_jax._src.planning.layout.set_default_nranks).
_layout.set_default_nranks(_comm_world_size)

_PUBLIC = {
    "Layout": "osmm_jax._src.planning.layout",
    "split_sizes": "osmm_jax._src.planning.layout",
    "Plan": "osmm_jax._src.planning.plan",
    "RankPlan": "osmm_jax._src.planning.plan",
    "LocalMultiply": "osmm_jax._src.planning.records",
    "LocalUpdate": "osmm_jax._src.planning.records",
    "Transfer": "osmm_jax._src.planning.records",
    "plan": "osmm_jax._src.runtime.api",
    "Work": "osmm_jax._src.planning.work",
    "three_d_layouts": "osmm_jax._src.planning.work",
    "gather": "osmm_jax._src.runtime.api",
    "stats": "osmm_jax._src.runtime.api",
    "release": "osmm_jax._src.runtime.api",
    "memory_budgets": "osmm_jax._src.runtime.api",
    "ChecksumError": "osmm_jax._src.runtime.checksum",
    "timeout": "osmm_jax._src.runtime.watchdog",
    "WatchdogTimeout": "osmm_jax._src.runtime.watchdog",
    "MethodSelector": "osmm_jax._src.tuning.fallback",
    "profile_speeds": "osmm_jax._src.tuning.speeds",
    "SpeedProfile": "osmm_jax._src.tuning.speeds",
    "declared_speeds": "osmm_jax._src.tuning.speeds",
    "balance": "osmm_jax._src.planning.balance",
    "Balance": "osmm_jax._src.planning.balance",
    "guarantees_balance": "osmm_jax._src.planning.balance",
    "enable_logging": "osmm_jax._src.log",
    "auto_layouts": "osmm_jax._src.planning.auto_layout",
    "LayoutChoice": "osmm_jax._src.planning.auto_layout",
    "Rebalancer": "osmm_jax._src.tuning.rebalance",
    "plot_plan": "osmm_jax._src.planning.plot",
    "plot_layout": "osmm_jax._src.planning.plot",
    "start_metrics": "osmm_jax._src.runtime.metrics",
    "write_metrics": "osmm_jax._src.runtime.metrics",
    "METHODS": "osmm_jax._src.config",
    "matmul": "osmm_jax._src.runtime.matmul",
    "rma_bytes": "osmm_jax._src.runtime.prediction",
    "memory_bytes": "osmm_jax._src.runtime.prediction",
    "PeakMemory": "osmm_jax._src.planning.memory",
}

__all__ = [
    "METHODS",
    "Balance",
    "ChecksumError",
    "Layout",
    "LayoutChoice",
    "LocalMultiply",
    "LocalUpdate",
    "MethodSelector",
    "PeakMemory",
    "Plan",
    "RankPlan",
    "Rebalancer",
    "SpeedProfile",
    "Transfer",
    "WatchdogTimeout",
    "Work",
    "auto_layouts",
    "balance",
    "declared_speeds",
    "enable_logging",
    "gather",
    "guarantees_balance",
    "matmul",
    "memory_budgets",
    "memory_bytes",
    "plan",
    "plot_layout",
    "plot_plan",
    "profile_speeds",
    "release",
    "rma_bytes",
    "split_sizes",
    "start_metrics",
    "stats",
    "three_d_layouts",
    "timeout",
    "write_metrics",
]


def __getattr__(name: str):
    if name == "flax":  # the Flax layers; needs flax installed
        return importlib.import_module("osmm_jax.flax")
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'osmm_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:
    from osmm_jax._src.config import METHODS
    from osmm_jax._src.log import enable_logging
    from osmm_jax._src.planning.auto_layout import LayoutChoice, auto_layouts
    from osmm_jax._src.planning.balance import Balance, balance, guarantees_balance
    from osmm_jax._src.planning.layout import Layout, split_sizes
    from osmm_jax._src.planning.memory import PeakMemory
    from osmm_jax._src.planning.plan import Plan, RankPlan
    from osmm_jax._src.planning.plot import plot_layout, plot_plan
    from osmm_jax._src.planning.records import LocalMultiply, LocalUpdate, Transfer
    from osmm_jax._src.planning.work import Work, three_d_layouts
    from osmm_jax._src.runtime.api import gather, memory_budgets, plan, stats
    from osmm_jax._src.runtime.checksum import ChecksumError
    from osmm_jax._src.runtime.matmul import matmul
    from osmm_jax._src.runtime.metrics import start_metrics, write_metrics
    from osmm_jax._src.runtime.prediction import memory_bytes, rma_bytes
    from osmm_jax._src.runtime.watchdog import WatchdogTimeout, timeout
    from osmm_jax._src.tuning.fallback import MethodSelector
    from osmm_jax._src.tuning.rebalance import Rebalancer
    from osmm_jax._src.tuning.speeds import SpeedProfile, declared_speeds, profile_speeds
