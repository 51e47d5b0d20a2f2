"""Tensor-parallel Flax layers and sync_grads against the stock layers on one process.

The kernels are split unevenly over the ranks (a rank with no columns from 2
ranks on); every rank holds the same input. A column-parallel then a
row-parallel layer (one block, tanh between) must give the stock two-layer
block's output on every rank, the stock input gradient on every rank, and each
rank's shard of the stock parameter gradients. sync_grads and value_and_grad
must make a data-parallel model with parameters outside the osmm_jax layers
get the gradient of one process on the whole batch, and leaving those
gradients un-summed must be noticed.

Sequence parallelism (``batch_sizes``): the activations' first dimension is
split over the ranks, unevenly (a rank with no batch entries from 2 ranks on).
The column-then-row block must give each rank its rows of the stock block's
output and of the input gradient; value_and_grad (or sync_grads with
summed_paths) must give each rank its shard of the stock parameter gradients
and the whole row-parallel bias gradient, and the one-process gradient of a
parameter outside the layers.

Three ranks cover what these tests check (uneven splits, a rank with nothing); the 4-rank run
keeps the two tests of replica groups (two groups of two ranks), which need four.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mpi4py import MPI

import osmm_jax

# The library's own gate (a Flax too old for its layers) is the skip reason.
om_flax = pytest.importorskip("osmm_jax.flax", exc_type=ImportError)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
IN, HID, OUT, ROWS = 4, 6, 3, 2
TOL = {"rtol": 1e-5, "atol": 1e-5}

# Hidden features (the column layer's columns, the row layer's rows) per rank.
SIZES = {1: [6], 2: [4, 2], 3: [4, 0, 2], 4: [1, 3, 0, 2]}[SIZE]
SIZES_ZERO_FIRST = {1: [6], 2: [0, 6], 3: [3, 3, 0], 4: [0, 2, 2, 2]}[SIZE]
# Sequence parallelism: batch entries (the activations' first dimension) per rank, and the
# second leading dimension (e.g. positions in a sequence) of every entry.
BATCH = {1: [3], 2: [1, 2], 3: [2, 0, 1], 4: [1, 2, 0, 1]}[SIZE]
BATCH_ZERO_FIRST = {1: [3], 2: [0, 3], 3: [0, 2, 1], 4: [0, 1, 2, 1]}[SIZE]
T = 2
# Nothing the tests marked with this check changes from three ranks to four (both split
# unevenly, with a rank that holds nothing): the 4-rank run keeps the tests of replica groups,
# which need four ranks.
UP_TO_THREE = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it; four run the replica groups")


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **TOL)


def _data(seed=0):
    """The input (ROWS, IN) and the output cotangent (ROWS, OUT), the same on every rank."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((ROWS, OUT)), jnp.float32)
    return x, g


def _mine(sizes):
    start = sum(sizes[:RANK])
    return slice(start, start + sizes[RANK])


class _Block(nn.Module):
    sizes: tuple = ()
    method: str | None = None
    stock: bool = False
    comm: object = None
    batch_sizes: tuple | None = None
    keep_fetched: bool = False

    @nn.compact
    def __call__(self, x):
        if self.stock:
            return nn.Dense(OUT, name="down")(jnp.tanh(nn.Dense(HID, name="up")(x)))
        kw = {
            "sizes": self.sizes,
            "method": self.method,
            "comm": self.comm,
            "batch_sizes": self.batch_sizes,
            "keep_fetched": self.keep_fetched,
        }
        h = om_flax.ColumnParallelDense(HID, name="up", **kw)(x)
        return om_flax.RowParallelDense(OUT, name="down", **kw)(jnp.tanh(h))


def _stock_params(seed=0):
    params = _Block(stock=True).init(jax.random.key(seed), jnp.zeros((1, IN)))
    # Nonzero biases, so that they show in outputs.
    return jax.tree.map(lambda p: p + 0.1 if p.ndim == 1 else p, params)


# -- linen ---------------------------------------------------------------------------------


@UP_TO_THREE
@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_linen_column_then_row_matches_stock(method):
    x, g = _data()
    stock = _Block(stock=True)
    ours = _Block(tuple(SIZES), method)
    ref = _stock_params()
    params = {
        "params": {
            "up": om_flax.shard_params(ref["params"]["up"], SIZES, RANK, split="column"),
            "down": om_flax.shard_params(ref["params"]["down"], SIZES, RANK, split="row"),
        }
    }

    def loss(block, p, x):
        return jnp.sum(block.apply(p, x) * g)  # the same global loss on every rank

    @jax.jit
    def step(p, x):
        return ours.apply(p, x), jax.grad(lambda p, x: loss(ours, p, x), argnums=(0, 1))(p, x)

    y, (d_params, d_x) = step(params, x)
    ref_params, ref_x = jax.grad(lambda p, x: loss(stock, p, x), argnums=(0, 1))(ref, x)

    _close(y, stock.apply(ref, x))
    _close(d_x, ref_x)  # the whole input gradient, on every rank
    assert d_params["params"]["up"]["kernel"].shape == (IN, SIZES[RANK])
    assert d_params["params"]["down"]["kernel"].shape == (SIZES[RANK], OUT)
    expected = {
        "up": om_flax.shard_params(ref_params["params"]["up"], SIZES, RANK, split="column"),
        "down": om_flax.shard_params(ref_params["params"]["down"], SIZES, RANK, split="row"),
    }
    jax.tree.map(_close, d_params["params"], expected)


@UP_TO_THREE
def test_linen_column_parallel_alone_with_a_share_of_the_loss():
    """Each rank's loss covers its own output columns; the input gradient is their sum."""
    x, _ = _data(1)
    g = jnp.asarray(np.random.default_rng(2).standard_normal((ROWS, 3, HID)), jnp.float32)
    x3 = jnp.stack([x, -x, 2 * x], axis=1)  # (ROWS, 3, IN): leading dimensions flatten
    ref = nn.Dense(HID).init(jax.random.key(3), x3)
    ref = {"params": {**ref["params"], "bias": jnp.linspace(-1.0, 1.0, HID)}}
    ours = om_flax.ColumnParallelDense(HID, sizes=SIZES_ZERO_FIRST)
    params = {"params": om_flax.shard_params(ref["params"], SIZES_ZERO_FIRST, RANK, split="column")}
    cols = _mine(SIZES_ZERO_FIRST)

    y, (d_params, d_x) = jax.value_and_grad(
        lambda p, x: jnp.sum(ours.apply(p, x) * g[..., cols]), argnums=(0, 1)
    )(params, x3)
    ref_params, ref_x = jax.grad(
        lambda p, x: jnp.sum(nn.Dense(HID).apply(p, x) * g), argnums=(0, 1)
    )(ref, x3)
    _close(ours.apply(params, x3), nn.Dense(HID).apply(ref, x3)[..., cols])
    _close(d_x, ref_x)
    jax.tree.map(
        _close,
        d_params["params"],
        om_flax.shard_params(ref_params["params"], SIZES_ZERO_FIRST, RANK, split="column"),
    )


@UP_TO_THREE
def test_linen_init_gives_the_stock_parameters_cut_and_gather_params_joins_them():
    x, _ = _data()
    params = _Block(tuple(SIZES)).init(jax.random.key(5), x)
    stock = _Block(stock=True).init(jax.random.key(5), x)
    up, down = params["params"]["up"], params["params"]["down"]
    assert up["kernel"].shape == (IN, SIZES[RANK]) and up["bias"].shape == (SIZES[RANK],)
    assert down["kernel"].shape == (SIZES[RANK], OUT) and down["bias"].shape == (OUT,)
    for name, split in (("up", "column"), ("down", "row")):
        whole = om_flax.gather_params(params["params"][name], SIZES, split=split)
        jax.tree.map(np.testing.assert_array_equal, whole, dict(stock["params"][name]))


# -- nnx -----------------------------------------------------------------------------------


class _NnxBlock(nnx.Module):
    def __init__(self, sizes, method, rngs, batch_sizes=None, comm=None, keep_fetched=False):
        kw = {"sizes": sizes, "method": method, "batch_sizes": batch_sizes, "rngs": rngs}
        kw["comm"], kw["keep_fetched"] = comm, keep_fetched
        self.up = om_flax.ColumnParallelLinear(IN, HID, **kw)
        self.down = om_flax.RowParallelLinear(HID, OUT, **kw)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


class _NnxStock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(IN, HID, rngs=rngs)
        self.down = nnx.Linear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


@UP_TO_THREE
@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_nnx_column_then_row_matches_stock(method):
    x, g = _data(4)
    sizes = SIZES_ZERO_FIRST
    stock = _NnxStock(nnx.Rngs(7))
    stock.up.bias[...] = jnp.linspace(-1.0, 1.0, HID)
    stock.down.bias[...] = jnp.linspace(0.5, 1.0, OUT)
    ours = _NnxBlock(sizes, method, nnx.Rngs(7))
    # The same rngs give the stock parameters, cut; then load the stock checkpoint's shard.
    np.testing.assert_array_equal(ours.up.kernel[...], stock.up.kernel[...][:, _mine(sizes)])
    np.testing.assert_array_equal(ours.down.kernel[...], stock.down.kernel[...][_mine(sizes)])
    for name, split in (("up", "column"), ("down", "row")):
        layer = getattr(stock, name)
        shard = om_flax.shard_params(nnx.state(layer), sizes, RANK, split=split)
        nnx.update(getattr(ours, name), shard)

    @nnx.jit
    def step(model, x):
        grads = nnx.grad(lambda m, x: jnp.sum(m(x) * g), argnums=(0, 1))(model, x)
        return model(x), grads

    y, (d_model, d_x) = step(ours, x)
    ref_model, ref_x = nnx.grad(lambda m, x: jnp.sum(m(x) * g), argnums=(0, 1))(stock, x)

    _close(y, stock(x))
    _close(d_x, ref_x)
    cols = _mine(sizes)
    _close(d_model["up"]["kernel"][...], ref_model["up"]["kernel"][...][:, cols])
    _close(d_model["up"]["bias"][...], ref_model["up"]["bias"][...][cols])
    _close(d_model["down"]["kernel"][...], ref_model["down"]["kernel"][...][cols])
    _close(d_model["down"]["bias"][...], ref_model["down"]["bias"][...])
    whole = om_flax.gather_params(nnx.state(ours.down), sizes, split="row")
    np.testing.assert_array_equal(whole["kernel"], stock.down.kernel[...])
    assert ours.up.sizes == tuple(sizes)
    hash(nnx.split(ours)[0])  # static attributes stay hashable (jit static arguments)


# -- bad sizes: the same clear error on every rank ------------------------------------------


def _column(sizes, x):
    return om_flax.ColumnParallelDense(HID, sizes=sizes).init(jax.random.key(0), x)


@UP_TO_THREE
def test_bad_sizes_raise_on_every_rank():
    x, _ = _data()
    cases = [
        ([*SIZES, 0], ValueError, rf"has {SIZE + 1} entries but the communicator has {SIZE}"),
        ([*SIZES[:-1], SIZES[-1] + 1], ValueError, rf"sum to {HID + 1} but the kernel has {HID}"),
        ([*SIZES[:-1], -1], ValueError, r"sizes\[\d+\] must be at least 0"),
        ([float(SIZES[0]), *SIZES[1:]], TypeError, r"sizes\[0\] must be an integer"),
        (None, TypeError, "sizes is required"),
    ]
    for sizes, error, message in cases:
        with pytest.raises(error, match=message):
            _column(sizes, x)
    with pytest.raises(ValueError, match="entries"):
        om_flax.RowParallelLinear(HID, OUT, sizes=SIZES[:-1] or [1, 1], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"sum to {HID} but the kernel has {HID + 1} rows"):
        om_flax.RowParallelLinear(HID + 1, OUT, sizes=SIZES, rngs=nnx.Rngs(0))
    # A row-parallel input with other than this rank's features.
    with pytest.raises(ValueError, match=r"expected \d+ local input features"):
        om_flax.RowParallelDense(OUT, sizes=SIZES).init(
            jax.random.key(0), jnp.zeros((ROWS, SIZES[RANK] + 1))
        )
    with pytest.raises(ValueError, match="do not pass dot_general"):
        om_flax.ColumnParallelLinear(
            IN, HID, sizes=SIZES, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0)
        )
    # Still usable afterwards.
    _column(SIZES, x)


@UP_TO_THREE
@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_ranks_that_disagree_on_sizes():
    x, _ = _data()
    # Valid on each rank alone (one entry per rank, summing to HID), but rank 0's differ.
    with pytest.raises(ValueError, match="ranks disagree .* same sizes"):
        _column(SIZES[::-1] if RANK == 0 else SIZES, x)
    with pytest.raises(ValueError, match="ranks disagree"):
        om_flax.gather_params(
            {"kernel": jnp.zeros((IN, SIZES[RANK])), "bias": jnp.zeros(SIZES[RANK])},
            SIZES if RANK else [*SIZES[:-1], SIZES[-1] + 1],
            split="column",
        )


# -- sync_grads: data parallelism with parameters outside the osmm_jax layers ----------------


def _row_sizes():
    return ([3, 0, 1, 2] if SIZE >= 3 else [3, 1])[:SIZE]


def _tokens(seed):
    """Rows per rank, every rank's tokens (the same on every rank), this rank's slice of them."""
    sizes = _row_sizes()
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 7, sum(sizes)), jnp.int32)
    return sizes, tokens, _mine(sizes)


def _features(seed):
    """Rows per rank, every rank's input rows (the same on every rank), this rank's slice."""
    sizes = _row_sizes()
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((sum(sizes), IN)), jnp.float32)
    return sizes, x, _mine(sizes)


class _DataParallel(nn.Module):
    row_sizes: tuple = ()

    @nn.compact
    def __call__(self, tokens):
        h = nn.LayerNorm()(nn.Embed(7, IN)(tokens))
        dense = (
            nn.Dense(HID) if not self.row_sizes else om_flax.Dense(HID, row_sizes=self.row_sizes)
        )
        return jnp.sum(dense(h) ** 2, axis=-1)


@UP_TO_THREE
def test_sync_grads_makes_data_parallel_training_match_one_process():
    sizes, tokens, mine = _tokens(9)
    stock, ours = _DataParallel(), _DataParallel(tuple(sizes))
    params = stock.init(jax.random.key(1), tokens)
    total = sum(sizes)

    skip = om_flax.summed_paths(ours, tokens[mine])
    assert skip == {("params", "Dense_0")}

    @jax.jit
    def grads(p, t):
        g = jax.grad(lambda p: jnp.sum(ours.apply(p, t)) / total)(p)
        return om_flax.sync_grads(g, skip)

    ref = jax.grad(lambda p: jnp.sum(stock.apply(p, tokens)) / total)(params)
    jax.tree.map(_close, grads(params, tokens[mine]), ref)


class _NnxNormDense(nnx.Module):
    """A LayerNorm (a parameter outside the osmm_jax layers) then a dense layer."""

    def __init__(self, dense):
        self.norm = nnx.LayerNorm(IN, rngs=nnx.Rngs(0))
        self.dense = dense


def _nnx_models(sizes):
    """The model with an osmm_jax data-parallel dense layer, and with the stock one."""
    ours = _NnxNormDense(om_flax.Linear(IN, OUT, row_sizes=sizes, rngs=nnx.Rngs(1)))
    return ours, _NnxNormDense(nnx.Linear(IN, OUT, rngs=nnx.Rngs(1)))


@UP_TO_THREE
def test_sync_grads_nnx_model_and_one_process():
    sizes, x, mine = _features(10)
    ours, stock = _nnx_models(sizes)

    def loss(m, x):
        return jnp.sum(jnp.tanh(m.dense(m.norm(x)))) / sum(sizes)

    d_ours = om_flax.sync_grads(nnx.grad(loss)(ours, x[mine]), ours, method="allreduce")
    d_ref = nnx.grad(loss)(stock, x)
    jax.tree.map(_close, nnx.to_pure_dict(d_ours), nnx.to_pure_dict(d_ref))


@UP_TO_THREE
def test_sync_grads_sums_every_leaf_not_skipped_in_one_product_per_dtype():
    mine = float(RANK + 1)
    grads = {
        "a": {"w": jnp.full((2, 3), mine)},
        "b": jnp.full(4, mine),
        "half": jnp.full(2, mine, jnp.float16),
        "osmm": {"kernel": jnp.full(3, mine)},
    }
    skip = {("osmm",)}
    jaxpr = jax.make_jaxpr(lambda g: om_flax.sync_grads(g, skip))(grads)
    products = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
    assert len(products) == 2  # float32 leaves together, float16 ones together
    out = om_flax.sync_grads(grads, skip)
    total = SIZE * (SIZE + 1) / 2
    _close(out["a"]["w"], np.full((2, 3), total))
    _close(out["b"], np.full(4, total))
    assert out["half"].dtype == jnp.float16
    _close(np.asarray(out["half"], np.float32), np.full(2, total))
    _close(out["osmm"]["kernel"], np.full(3, mine))  # already summed: left alone


# -- value_and_grad: the gradients of the global loss without naming the summed paths -----------


@UP_TO_THREE
def test_value_and_grad_linen_matches_one_process_inside_jit():
    sizes, tokens, mine = _tokens(11)
    stock, ours = _DataParallel(), _DataParallel(tuple(sizes))
    params = stock.init(jax.random.key(2), tokens)
    total = sum(sizes)

    @jax.jit
    def step(p, t):
        return om_flax.value_and_grad(lambda p: jnp.sum(ours.apply(p, t)) / total)(p)

    local_loss, grads = step(params, tokens[mine])
    ref_loss, ref = jax.value_and_grad(lambda p: jnp.sum(stock.apply(p, tokens)) / total)(params)
    jax.tree.map(_close, grads, ref)
    whole = MPI.COMM_WORLD.allreduce(float(local_loss))
    np.testing.assert_allclose(whole, float(ref_loss), rtol=1e-5)
    # Only the parameters (argument 0) here; the embedding table of 'params' alone as well.
    inner = jax.jit(
        om_flax.grad(lambda q, t: jnp.sum(ours.apply({"params": q}, t)) / total, argnums=0)
    )(params["params"], tokens[mine])
    jax.tree.map(_close, inner, ref["params"])


@UP_TO_THREE
def test_value_and_grad_nnx_with_aux_matches_one_process():
    sizes, x, mine = _features(12)
    ours, stock = _nnx_models(sizes)

    def loss(m, x):
        y = jnp.tanh(m.dense(m.norm(x)))
        return jnp.sum(y) / sum(sizes), y.shape[0]

    (_, rows), d_ours = nnx.jit(om_flax.value_and_grad(loss, has_aux=True))(ours, x[mine])
    assert rows == sizes[RANK]
    d_ref = nnx.grad(loss, has_aux=True)(stock, x)[0]
    jax.tree.map(_close, nnx.to_pure_dict(d_ours), nnx.to_pure_dict(d_ref))


@UP_TO_THREE
def test_applying_unsummed_gradients_warns_once_and_can_be_refused():
    from osmm_jax._src.nn import unsummed_grads

    sizes, tokens, mine = _tokens(13)
    ours = _DataParallel(tuple(sizes))
    params = _DataParallel().init(jax.random.key(3), tokens)
    t = tokens[mine]

    def wrong(p):
        return jax.grad(lambda p: jnp.sum(ours.apply(p, t)))(p)

    unsummed_grads.reset()
    with pytest.warns(om_flax.UnsummedGradientsWarning, match="LayerNorm_0/scale"):
        jax.jit(wrong)(params)
    unsummed_grads.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", om_flax.UnsummedGradientsWarning)
        with pytest.raises(om_flax.UnsummedGradientsWarning, match="Embed_0/embedding"):
            jax.jit(lambda p: wrong(p))(params)  # a new function: traced again, judged again
        # Summed: no warning (an error here).
        skip = om_flax.summed_paths(ours, t)
        jax.jit(lambda p: om_flax.sync_grads(wrong(p), skip))(params)
        jax.jit(om_flax.grad(lambda p: jnp.sum(ours.apply(p, t))))(params)
    unsummed_grads.reset()


@UP_TO_THREE
def test_value_and_grad_leaves_layers_it_does_not_differentiate_to_their_own_grad():
    sizes, tokens, mine = _tokens(14)
    ours, stock = _DataParallel(tuple(sizes)), _DataParallel()
    params = stock.init(jax.random.key(4), tokens)
    t = tokens[mine]

    def outer(p):
        # value_and_grad differentiates only `scale`; the layer's parameters belong to the
        # outer jax.grad, which gets the Dense gradients summed by the product as usual.
        _, d_scale = om_flax.value_and_grad(lambda scale: scale * jnp.sum(ours.apply(p, t)))(1.0)
        return d_scale

    d_scale = jax.jit(outer)(params)
    whole = float(jnp.sum(stock.apply(params, tokens)))
    np.testing.assert_allclose(float(d_scale), whole, rtol=1e-5)  # summed over ranks
    d_params = jax.jit(jax.grad(outer))(params)
    ref = jax.grad(lambda p: jnp.sum(stock.apply(p, tokens)))(params)
    _close(d_params["params"]["Dense_0"]["kernel"], ref["params"]["Dense_0"]["kernel"])


@pytest.mark.ranks(4, reason="two replicas of a two-rank tensor-parallel group")
def test_tensor_parallel_groups_replicated_data_parallel():
    """Ranks {0, 1} and {2, 3} each run the block tensor-parallel on half the batch; the
    replicas {0, 2} and {1, 3} then sum their gradients with sync_grads over their own
    communicator: the gradients of one process on the whole batch."""
    tp_comm = MPI.COMM_WORLD.Split(RANK // 2, RANK)
    dp_comm = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    sizes, tp_rank, replica = (5, 1), RANK % 2, RANK // 2
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((4, IN)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4, OUT)), jnp.float32)
    rows = slice(2 * replica, 2 * replica + 2)
    ref = _stock_params(2)
    ours = _Block(sizes, comm=tp_comm)
    params = {
        "params": {
            "up": om_flax.shard_params(ref["params"]["up"], sizes, tp_rank, split="column"),
            "down": om_flax.shard_params(ref["params"]["down"], sizes, tp_rank, split="row"),
        }
    }
    # This replica's share of the global loss, the same on both ranks of its group.
    local = jax.grad(lambda p: jnp.sum(ours.apply(p, x[rows]) * g[rows]))(params)
    d_params = om_flax.sync_grads(local, comm=dp_comm)
    ref_grads = jax.grad(lambda p: jnp.sum(_Block(stock=True).apply(p, x) * g))(ref)
    expected = {
        "up": om_flax.shard_params(ref_grads["params"]["up"], sizes, tp_rank, split="column"),
        "down": om_flax.shard_params(ref_grads["params"]["down"], sizes, tp_rank, split="row"),
    }
    jax.tree.map(_close, d_params["params"], expected)


@pytest.mark.ranks(4, reason="two replicas of a two-rank sequence-parallel group")
def test_value_and_grad_refuses_sequence_parallel_layers_on_another_communicator():
    """Sequence-parallel layers on a group's communicator complete their gradients over that
    group only: summing over the replicas' communicator (or the world's) would leave them
    partial, so value_and_grad refuses, on every rank, for nnx and linen."""
    tp_comm = MPI.COMM_WORLD.Split(RANK // 2, RANK)
    dp_comm = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    sizes, batch = (4, 2), (1, 2)
    x = jnp.ones((batch[RANK % 2], T, IN), jnp.float32)
    ours = _NnxBlock(sizes, None, nnx.Rngs(0), batch, comm=tp_comm)
    linen = _Block(sizes, comm=tp_comm, batch_sizes=batch)
    params = linen.init(jax.random.key(0), x)
    message = "sequence-parallel layer .* on a communicator other than"
    for comm in (dp_comm, None):
        with pytest.raises(ValueError, match=message):
            om_flax.value_and_grad(lambda m, x: jnp.sum(m(x)), comm=comm)(ours, x)
        with pytest.raises(ValueError, match=message):
            om_flax.value_and_grad(lambda p, x: jnp.sum(linen.apply(p, x)), comm=comm)(params, x)
    # On the layers' own communicator it sums what they leave (here: nothing else).
    om_flax.value_and_grad(lambda m, x: jnp.sum(m(x)), comm=tp_comm)(ours, x)


# -- sequence parallelism: the activations split by batch entries (batch_sizes) ----------------


def _seq_data(batch, seed):
    """The whole input (B, T, IN) and output cotangent (B, T, OUT), B = sum(batch), the same
    on every rank: each rank takes its own batch entries of them."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((sum(batch), T, IN)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((sum(batch), T, OUT)), jnp.float32)
    return x, g


def _shards(block, sizes):
    """This rank's shards of a stock block's ``{"up": ..., "down": ...}`` parameters (or
    gradients): the column layer's columns, the row layer's rows and its whole bias."""
    return {
        "up": om_flax.shard_params(block["up"], sizes, RANK, split="column"),
        "down": om_flax.shard_params(block["down"], sizes, RANK, split="row"),
    }


@UP_TO_THREE
@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_linen_sequence_parallel_block_gives_this_ranks_batch_entries(method):
    batch, sizes = BATCH_ZERO_FIRST, SIZES
    x, g = _seq_data(batch, 20)
    rows = _mine(batch)
    stock = _Block(stock=True)
    ours = _Block(tuple(sizes), method, batch_sizes=tuple(batch))
    ref = _stock_params(3)
    params = {"params": _shards(ref["params"], sizes)}

    def loss(p, x):
        return jnp.sum(ours.apply(p, x) * g[rows])  # this rank's share of the global loss

    @jax.jit
    def step(p, x):
        value, d_params = om_flax.value_and_grad(loss)(p, x)
        return ours.apply(p, x), value, d_params, jax.grad(loss, argnums=1)(p, x)

    y, value, d_params, d_x = step(params, x[rows])
    ref_loss, (ref_params, ref_x) = jax.value_and_grad(
        lambda p, x: jnp.sum(stock.apply(p, x) * g), argnums=(0, 1)
    )(ref, x)

    assert y.shape == (batch[RANK], T, OUT) and d_x.shape == (batch[RANK], T, IN)
    _close(y, stock.apply(ref, x)[rows])
    _close(d_x, ref_x[rows])  # this rank's entries of the whole input gradient
    np.testing.assert_allclose(MPI.COMM_WORLD.allreduce(float(value)), float(ref_loss), **TOL)
    assert d_params["params"]["up"]["kernel"].shape == (IN, sizes[RANK])
    assert d_params["params"]["down"]["bias"].shape == (OUT,)
    # Kernel shards and the column bias shard as the layers complete them; the row bias (this
    # rank's entries only) summed by value_and_grad: the whole stock gradient.
    jax.tree.map(_close, d_params["params"], _shards(ref_params["params"], sizes))


def _nnx_pair(sizes, method=None, batch_sizes=None, seed=7, keep_fetched=False):
    """Ours (this rank's shards) and the stock block, with nonzero biases."""
    stock = _NnxStock(nnx.Rngs(seed))
    stock.up.bias[...] = jnp.linspace(-1.0, 1.0, HID)
    stock.down.bias[...] = jnp.linspace(0.5, 1.0, OUT)
    ours = _NnxBlock(sizes, method, nnx.Rngs(seed), batch_sizes, keep_fetched=keep_fetched)
    for name, split in (("up", "column"), ("down", "row")):
        shard = om_flax.shard_params(nnx.state(getattr(stock, name)), sizes, RANK, split=split)
        nnx.update(getattr(ours, name), shard)
    return ours, stock


def _stock_loss(g):
    """The global loss of a stock nnx model on the whole batch."""
    return lambda m, x: jnp.sum(m(x) * g)


@UP_TO_THREE
@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_nnx_sequence_parallel_block_gives_this_ranks_batch_entries(method):
    batch, sizes = BATCH, SIZES_ZERO_FIRST
    x, g = _seq_data(batch, 21)
    rows = _mine(batch)
    ours, stock = _nnx_pair(sizes, method, batch)

    def loss(m, x):
        return jnp.sum(m(x) * g[rows])

    @nnx.jit
    def step(model, x):
        value, d_model = om_flax.value_and_grad(loss)(model, x)
        return model(x), value, d_model, nnx.grad(loss, argnums=1)(model, x)

    y, value, d_model, d_x = step(ours, x[rows])
    ref_loss, (ref_model, ref_x) = nnx.value_and_grad(_stock_loss(g), argnums=(0, 1))(stock, x)

    assert y.shape == (batch[RANK], T, OUT) and d_x.shape == (batch[RANK], T, IN)
    _close(y, stock(x)[rows])
    _close(d_x, ref_x[rows])
    np.testing.assert_allclose(MPI.COMM_WORLD.allreduce(float(value)), float(ref_loss), **TOL)
    expected = _shards(nnx.to_pure_dict(ref_model), sizes)
    jax.tree.map(_close, nnx.to_pure_dict(d_model), expected)


def _sp_step_bits(keep):
    """A linen and an nnx sequence-parallel block's output, input gradient and parameter
    gradients (second jitted run), with the column layers keeping what they gathered or not,
    and the RMA bytes this rank issued in that run."""
    batch, sizes = BATCH, SIZES
    x, g = _seq_data(batch, 24)
    rows = _mine(batch)
    linen = _Block(tuple(sizes), "one_sided", batch_sizes=tuple(batch), keep_fetched=keep)
    params = {"params": _shards(_stock_params(5)["params"], sizes)}
    ours, _ = _nnx_pair(sizes, "one_sided", batch, keep_fetched=keep)

    def loss(p, x):
        return jnp.sum(linen.apply(p, x) * g[rows])

    def nnx_loss(m, x):
        return jnp.sum(m(x) * g[rows])

    @jax.jit
    def linen_step(p, x):
        return om_flax.grad(loss)(p, x), jax.grad(loss, argnums=1)(p, x)

    @nnx.jit
    def nnx_step(model, x):
        return om_flax.grad(nnx_loss)(model, x), nnx.grad(nnx_loss, argnums=1)(model, x)

    outs = []
    for step, state in ((linen_step, params), (nnx_step, ours)):
        jax.block_until_ready(step(state, x[rows]))
        before = osmm_jax.stats()["rma_bytes"]
        outs.append(jax.block_until_ready(step(state, x[rows])))
        outs.append(osmm_jax.stats()["rma_bytes"] - before)
    return outs


@pytest.mark.ranks(min=2, reason="one rank gathers nothing")
def test_sequence_parallel_layers_keeping_what_they_gathered_give_the_same_bits():
    """keep_fetched: the column layer's backward products take the rows (and kernel columns)
    its forward product gathered instead of gathering them again: fewer bytes, same bits."""
    kept = _sp_step_bits(True)
    again = _sp_step_bits(False)
    for got, expected in ((kept[0], again[0]), (kept[2], again[2])):
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    moved = MPI.COMM_WORLD.allreduce(np.array([kept[1], kept[3], again[1], again[3]]))
    assert moved[0] < moved[2] and moved[1] < moved[3], moved


class _NormBlock(nn.Module):
    """A LayerNorm (parameters outside the osmm_jax layers) then the block."""

    sizes: tuple = ()
    batch_sizes: tuple | None = None
    stock: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm")(x)
        return _Block(self.sizes, stock=self.stock, batch_sizes=self.batch_sizes, name="block")(h)


@UP_TO_THREE
def test_linen_sequence_parallel_parameters_outside_the_layers_get_one_process_gradients():
    batch, sizes = BATCH, SIZES
    x, g = _seq_data(batch, 22)
    rows = _mine(batch)
    stock, ours = _NormBlock(stock=True), _NormBlock(tuple(sizes), tuple(batch))
    ref = stock.init(jax.random.key(6), x)
    ref = jax.tree.map(lambda p: p + 0.1 if p.ndim == 1 else p, ref)  # LayerNorm too
    params = {"params": {"norm": ref["params"]["norm"]}}
    params["params"]["block"] = _shards(ref["params"]["block"], sizes)

    def loss(p, x):
        return jnp.sum(ours.apply(p, x) * g[rows])

    skip = om_flax.summed_paths(ours, x[rows])
    assert skip == {("params", "block", "up"), ("params", "block", "down", "kernel")}
    _, by_value_and_grad = jax.jit(om_flax.value_and_grad(loss))(params, x[rows])
    by_hand = jax.jit(lambda p, x: om_flax.sync_grads(jax.grad(loss)(p, x), skip))(params, x[rows])

    ref_grads = jax.grad(lambda p: jnp.sum(stock.apply(p, x) * g))(ref)["params"]
    expected = {"norm": ref_grads["norm"], "block": _shards(ref_grads["block"], sizes)}
    jax.tree.map(_close, by_value_and_grad["params"], expected)
    jax.tree.map(_close, by_hand["params"], expected)


class _NnxNormBlock(nnx.Module):
    """A LayerNorm (parameters outside the osmm_jax layers) then a block."""

    def __init__(self, block):
        self.norm = nnx.LayerNorm(IN, rngs=nnx.Rngs(0))
        self.norm.scale[...] = jnp.linspace(0.5, 1.5, IN)
        self.norm.bias[...] = jnp.linspace(-0.2, 0.2, IN)
        self.block = block

    def __call__(self, x):
        return self.block(self.norm(x))


@UP_TO_THREE
def test_nnx_sequence_parallel_parameters_outside_the_layers_get_one_process_gradients():
    batch, sizes = BATCH, SIZES_ZERO_FIRST
    x, g = _seq_data(batch, 23)
    rows = _mine(batch)
    ours, stock = (_NnxNormBlock(block) for block in _nnx_pair(sizes, batch_sizes=batch))

    def loss(m, x):
        return jnp.sum(m(x) * g[rows])

    skip = om_flax.summed_paths(ours)
    assert skip == {("block", "up"), ("block", "down", "kernel")}
    _, by_value_and_grad = nnx.jit(om_flax.value_and_grad(loss))(ours, x[rows])
    by_model = nnx.jit(lambda m, x: om_flax.sync_grads(nnx.grad(loss)(m, x), m))(ours, x[rows])
    by_paths = nnx.jit(lambda m, x: om_flax.sync_grads(nnx.grad(loss)(m, x), skip))(ours, x[rows])

    ref = nnx.to_pure_dict(nnx.grad(_stock_loss(g))(stock, x))
    expected = {"norm": ref["norm"], "block": _shards(ref["block"], sizes)}
    for grads in (by_value_and_grad, by_model, by_paths):
        jax.tree.map(_close, nnx.to_pure_dict(grads), expected)


@UP_TO_THREE
def test_summed_paths_name_what_sequence_parallel_layers_complete():
    x = jnp.zeros((BATCH[RANK], T, IN))
    sp, _ = _nnx_pair(SIZES, batch_sizes=BATCH)
    tp, _ = _nnx_pair(SIZES)
    # The column layer's kernel and bias, the row layer's kernel (its bias is this rank's
    # entries' only); without batch_sizes the shards are not summed at all: nothing.
    assert om_flax.summed_paths(sp) == {("up",), ("down", "kernel")}
    assert om_flax.summed_paths(tp) == frozenset()
    linen_sp = _Block(tuple(SIZES), batch_sizes=tuple(BATCH))
    assert om_flax.summed_paths(linen_sp, x) == {("params", "up"), ("params", "down", "kernel")}
    whole = jnp.zeros((sum(BATCH), T, IN))
    assert om_flax.summed_paths(_Block(tuple(SIZES)), whole) == frozenset()


@UP_TO_THREE
def test_an_unsummed_row_parallel_bias_is_noticed():
    from osmm_jax._src.nn import unsummed_grads

    x, g = _seq_data(BATCH, 24)
    rows = _mine(BATCH)
    ours, _ = _nnx_pair(SIZES, batch_sizes=BATCH)
    linen = _Block(tuple(SIZES), batch_sizes=tuple(BATCH))
    params = {"params": _shards(_stock_params(4)["params"], SIZES)}

    def nnx_loss(m, x):
        return jnp.sum(m(x) * g[rows])

    def linen_loss(p, x):
        return jnp.sum(linen.apply(p, x) * g[rows])

    unsummed_grads.reset()
    with pytest.warns(om_flax.UnsummedGradientsWarning, match=r"\('down/bias'\)"):
        nnx.jit(nnx.grad(nnx_loss))(ours, x[rows])
    unsummed_grads.reset()
    with pytest.warns(om_flax.UnsummedGradientsWarning, match=r"\('down/bias'\)"):
        jax.jit(jax.grad(linen_loss))(params, x[rows])
    unsummed_grads.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", om_flax.UnsummedGradientsWarning)
        nnx.jit(om_flax.value_and_grad(nnx_loss))(ours, x[rows])
        jax.jit(om_flax.value_and_grad(linen_loss))(params, x[rows])
    unsummed_grads.reset()


# -- bad batch_sizes and inputs: the same clear error on every rank --------------------------


def _sp_layers(batch_sizes, sizes=SIZES):
    """Build (and for linen, initialise on this rank's input) every sequence-parallel layer with
    ``batch_sizes``: the two linen ones, the two nnx ones."""
    column = om_flax.ColumnParallelDense(HID, sizes=sizes, batch_sizes=batch_sizes)
    row = om_flax.RowParallelDense(OUT, sizes=sizes, batch_sizes=batch_sizes)
    yield lambda: column.init(jax.random.key(0), jnp.zeros((BATCH[RANK], T, IN)))
    yield lambda: row.init(jax.random.key(0), jnp.zeros((sum(BATCH), T, sizes[RANK])))
    kw = {"sizes": sizes, "batch_sizes": batch_sizes, "rngs": nnx.Rngs(0)}
    yield lambda: om_flax.ColumnParallelLinear(IN, HID, **kw)
    yield lambda: om_flax.RowParallelLinear(HID, OUT, **kw)


@UP_TO_THREE
def test_bad_batch_sizes_raise_on_every_rank():
    cases = [
        ([*BATCH, 1], ValueError, rf"has {SIZE + 1} entries but the communicator has {SIZE} ranks"),
        ([*BATCH[:-1], -1], ValueError, rf"rank 0: batch_sizes\[{SIZE - 1}\] must be at least 0"),
        ([float(BATCH[0]), *BATCH[1:]], TypeError, r"rank 0: batch_sizes\[0\] must be an integer"),
        (BATCH[RANK], TypeError, "batch_sizes must be a sequence of batch entries, one per rank"),
        ("3", TypeError, "batch_sizes must be a sequence of batch entries"),
    ]
    for batch_sizes, error, message in cases:
        for build in _sp_layers(batch_sizes):
            # Every rank finds it (they all hold the same list) and says so, before any data moves.
            with pytest.raises(
                error, match=rf"invalid input on {SIZE} of {SIZE} ranks: .*{message}"
            ):
                build()
    # Still usable afterwards, all of them.
    for build in _sp_layers(BATCH):
        build()


@UP_TO_THREE
def test_inputs_of_other_batch_entries_raise_on_every_rank():
    column = om_flax.ColumnParallelDense(HID, sizes=SIZES, batch_sizes=BATCH)
    row = om_flax.RowParallelDense(OUT, sizes=SIZES, batch_sizes=BATCH)
    key = jax.random.key(0)
    extra = 1 if RANK == 0 else 0  # rank 0's input only is wrong
    with pytest.raises(
        ValueError,
        match=rf"invalid input on 1 of {SIZE} ranks: rank 0: the input has {BATCH[0] + 1} batch "
        rf"entries \(shape .*\) but this rank's batch_sizes\[0\] is {BATCH[0]}",
    ):
        column.init(key, jnp.zeros((BATCH[RANK] + extra, T, IN)))
    with pytest.raises(
        ValueError,
        match=rf"rank 0: the input has {sum(BATCH) + 1} batch entries .* but every rank's \(the "
        rf"sum of batch_sizes\) is {sum(BATCH)}",
    ):
        row.init(key, jnp.zeros((sum(BATCH) + extra, T, SIZES[RANK])))
    # A row-parallel layer takes every rank's entries, not this rank's own.
    if sum(BATCH) != BATCH[0]:
        with pytest.raises(ValueError, match=r"rank 0: the input has \d+ batch entries"):
            row.init(key, jnp.zeros((BATCH[RANK], T, SIZES[RANK])))
    with pytest.raises(
        ValueError, match=r"with batch_sizes a layer needs \(batch, \.\.\., features\)"
    ):
        column.init(key, jnp.zeros((IN,)))
    # nnx: checked at the call.
    layer = om_flax.ColumnParallelLinear(IN, HID, sizes=SIZES, batch_sizes=BATCH, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"rank 0: the input has .* batch_sizes\[0\] is"):
        layer(jnp.zeros((BATCH[RANK] + extra, T, IN)))
    with pytest.raises(ValueError, match=r"rank 0: the input has .* batch_sizes\[0\] is"):
        nnx.jit(lambda m, x: m(x))(layer, jnp.zeros((BATCH[RANK] + extra, T, IN)))
    # Still usable afterwards: the rows of every rank gathered.
    y = layer(jnp.ones((BATCH[RANK], T, IN)))
    assert y.shape == (sum(BATCH), T, SIZES[RANK])
    params = column.init(key, jnp.ones((BATCH[RANK], T, IN)))
    assert column.apply(params, jnp.ones((BATCH[RANK], T, IN))).shape == y.shape


@UP_TO_THREE
@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_ranks_that_disagree_on_batch_sizes():
    key = jax.random.key(0)
    x = jnp.zeros((BATCH[RANK], T, IN))
    # Rank 0's own entry is right, but its list differs from the others'.
    other = [*BATCH[:-1], BATCH[-1] + 1]
    with pytest.raises(ValueError, match="ranks disagree .* same sizes, batch sizes"):
        om_flax.ColumnParallelDense(
            HID, sizes=SIZES, batch_sizes=other if RANK == 0 else BATCH
        ).init(key, x)
    # batch_sizes on some ranks only.
    with pytest.raises(ValueError, match="ranks disagree"):
        om_flax.ColumnParallelDense(
            HID, sizes=SIZES, batch_sizes=None if RANK == 0 else BATCH
        ).init(key, x)
    # The dimensions after the batch dimension must agree.
    with pytest.raises(ValueError, match="ranks disagree"):
        om_flax.ColumnParallelDense(HID, sizes=SIZES, batch_sizes=BATCH).init(
            key, jnp.zeros((BATCH[RANK], T + (RANK == 0), IN))
        )
