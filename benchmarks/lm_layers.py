"""The dense layers ``benchmarks.lm_step`` builds examples/train_lm.py's GPT with, besides the
model's own: stand-ins for its no-communication floors (a rank's tensor-parallel shards, with or
without its own sequences between the pairs), JAX's own even tensor-parallel split (padded to
whole shards) and where it keeps each parameter, and stock layers that meet the other ranks
once per layer in the backward pass. ``lm`` is examples/train_lm.py, loaded as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from benchmarks.common import RANK
from benchmarks.overlap_step import rendezvous


def _load_train_lm():
    """examples/train_lm.py as a module (examples/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lm = _load_train_lm()


class ShardLayers(lm.Layers):
    """Stock dense layers cut to this rank's tensor-parallel shard: what a TP step computes,
    without its sums (the TP no-communication floor)."""

    def dense(self, kind: str, n_in: int, n_out: int, rngs, sizes=None):
        if kind == "column":
            return lm.StockLinear(n_in, sizes[RANK], rngs=rngs)
        if kind == "row":
            return lm.StockLinear(sizes[RANK], n_out, rngs=rngs)
        return lm.StockLinear(n_in, n_out, rngs=rngs)


class SequenceShardLayers(ShardLayers):
    """The TP + sequence-parallel step without its communication: between the pairs each rank
    has its own sequences (``batch_sizes[RANK]`` of ``sum(batch_sizes)``); a column layer
    stands in for the gather by repeating them to the whole batch, a row layer for the
    reduce-scatter by keeping its first rows (the SP no-communication floor)."""

    def dense(self, kind: str, n_in: int, n_out: int, rngs, sizes=None):
        layer = super().dense(kind, n_in, n_out, rngs, sizes)
        if kind in ("column", "row"):
            return SequenceStandIn(layer, kind, self.batch_sizes)
        return layer


class SequenceStandIn(nnx.Module):
    def __init__(self, layer, kind: str, batch_sizes):
        self.layer, self.kind = layer, kind
        self.total, self.own = sum(batch_sizes), batch_sizes[RANK]

    def __call__(self, x):
        if self.kind == "column":  # own sequences -> the whole batch
            return self.layer(jnp.resize(x, (self.total, *x.shape[1:])))
        return self.layer(x)[: self.own]  # the whole batch -> own sequences


class EvenShardLayers(lm.Layers):
    """Stock dense layers for JAX's own tensor parallelism, which splits a dimension only into
    ``nranks`` equal parts: each tensor-parallel pair's inner width (``heads`` heads of the
    attention pair, ``4 d`` features of the MLP pair) padded with zeros to a multiple of
    ``nranks`` heads or features. The zero columns and rows change neither the loss nor any
    other gradient (their own stay zero, and so does adam's update of them): the step is the
    model's, and their arithmetic is the price of the even split."""

    def __init__(self, nranks: int, heads: int, d: int):
        # Every head and every hidden feature a unit of its own: a pair's ``sizes`` below.
        super().__init__("single", head_sizes=[1] * heads, mlp_sizes=[1] * (4 * d))
        self.nranks = nranks

    def dense(self, kind: str, n_in: int, n_out: int, rngs, sizes=None):
        layer = lm.StockLinear(n_in, n_out, rngs=rngs)  # drawn as the model's own, then padded
        if kind == "other":
            return layer
        width = n_out if kind == "column" else n_in
        pad = -width % (sizes[0] * self.nranks)  # sizes[0]: one unit's columns (rows)
        if kind == "column":
            layer.kernel = nnx.Param(jnp.pad(layer.kernel[...], ((0, 0), (0, pad))))
            layer.bias = nnx.Param(jnp.pad(layer.bias[...], (0, pad)))
        else:
            layer.kernel = nnx.Param(jnp.pad(layer.kernel[...], ((0, pad), (0, 0))))
        return layer


def megatron_spec(path: str, param) -> P:
    """Where JAX's tensor-parallel step keeps ``param`` (its key path ``path``): the column
    layers (qkv, up) split by output features, the row layers (proj, down) by input features
    (their bias replicated), everything else replicated; over the mesh's one axis."""
    layer = next((n for n in ("qkv", "up", "proj", "down") if f"['{n}']" in path), None)
    if layer in ("qkv", "up"):
        return P(None, "data") if param.ndim == 2 else P("data")
    if layer in ("proj", "down") and param.ndim == 2:
        return P("data", None)
    return P()


class MeetingLayers(lm.Layers):
    """Stock dense layers whose input meets every rank in the backward pass
    (``overlap_step.rendezvous``): the fused DP step with the synchronisation of one sum per
    layer, but none of its bytes."""

    def __init__(self):
        super().__init__("single")
        self.meet = rendezvous("one_sided")

    def dense(self, kind: str, n_in: int, n_out: int, rngs, sizes=None):
        return MeetingLinear(self.meet, n_in, n_out, rngs=rngs)


class MeetingLinear(lm.StockLinear):
    def __init__(self, meet, n_in: int, n_out: int, *, rngs):
        super().__init__(n_in, n_out, rngs=rngs)
        self.meet = meet

    def __call__(self, x):
        return super().__call__(self.meet(x))
