"""Tensor-parallel Flax layers and sync_grads against the stock layers on one process.

The kernels are split unevenly over the ranks (a rank with no columns from 2
ranks on); every rank holds the same input. A column-parallel then a
row-parallel layer (one block, tanh between) must give the stock two-layer
block's output on every rank, the stock input gradient on every rank, and each
rank's shard of the stock parameter gradients. sync_grads and value_and_grad
must make a data-parallel model with parameters outside the osmm_jax layers
get the gradient of one process on the whole batch, and leaving those
gradients un-summed must be noticed.
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

from osmm_jax import flax as om_flax

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
IN, HID, OUT, ROWS = 4, 6, 3, 2
TOL = {"rtol": 1e-5, "atol": 1e-5}

# Hidden features (the column layer's columns, the row layer's rows) per rank.
SIZES = {1: [6], 2: [4, 2], 3: [4, 0, 2], 4: [1, 3, 0, 2]}[SIZE]
SIZES_ZERO_FIRST = {1: [6], 2: [0, 6], 3: [3, 3, 0], 4: [0, 2, 2, 2]}[SIZE]


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

    @nn.compact
    def __call__(self, x):
        if self.stock:
            return nn.Dense(OUT, name="down")(jnp.tanh(nn.Dense(HID, name="up")(x)))
        kw = {"sizes": self.sizes, "method": self.method, "comm": self.comm}
        h = om_flax.ColumnParallelDense(HID, name="up", **kw)(x)
        return om_flax.RowParallelDense(OUT, name="down", **kw)(jnp.tanh(h))


def _stock_params(seed=0):
    params = _Block(stock=True).init(jax.random.key(seed), jnp.zeros((1, IN)))
    # Nonzero biases, so that they show in outputs.
    return jax.tree.map(lambda p: p + 0.1 if p.ndim == 1 else p, params)


# -- linen ---------------------------------------------------------------------------------


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
    def __init__(self, sizes, method, rngs):
        self.up = om_flax.ColumnParallelLinear(IN, HID, sizes=sizes, method=method, rngs=rngs)
        self.down = om_flax.RowParallelLinear(HID, OUT, sizes=sizes, method=method, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


class _NnxStock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(IN, HID, rngs=rngs)
        self.down = nnx.Linear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


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


class _DataParallel(nn.Module):
    row_sizes: tuple = ()

    @nn.compact
    def __call__(self, tokens):
        h = nn.LayerNorm()(nn.Embed(7, IN)(tokens))
        dense = (
            nn.Dense(HID) if not self.row_sizes else om_flax.Dense(HID, row_sizes=self.row_sizes)
        )
        return jnp.sum(dense(h) ** 2, axis=-1)


def test_sync_grads_makes_data_parallel_training_match_one_process():
    sizes = _row_sizes()
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 7, sum(sizes)), jnp.int32)
    mine = _mine(sizes)
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


def test_sync_grads_nnx_model_and_one_process():
    sizes = _row_sizes()
    x = jnp.asarray(np.random.default_rng(10).standard_normal((sum(sizes), IN)), jnp.float32)
    mine = _mine(sizes)

    ours, stock = _nnx_models(sizes)

    def loss(m, x):
        return jnp.sum(jnp.tanh(m.dense(m.norm(x)))) / sum(sizes)

    d_ours = om_flax.sync_grads(nnx.grad(loss)(ours, x[mine]), ours, method="allreduce")
    d_ref = nnx.grad(loss)(stock, x)
    jax.tree.map(_close, nnx.to_pure_dict(d_ours), nnx.to_pure_dict(d_ref))


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


def test_value_and_grad_linen_matches_one_process_inside_jit():
    sizes = _row_sizes()
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 7, sum(sizes)), jnp.int32)
    mine = _mine(sizes)
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


def test_value_and_grad_nnx_with_aux_matches_one_process():
    sizes = _row_sizes()
    x = jnp.asarray(np.random.default_rng(12).standard_normal((sum(sizes), IN)), jnp.float32)
    mine = _mine(sizes)

    ours, stock = _nnx_models(sizes)

    def loss(m, x):
        y = jnp.tanh(m.dense(m.norm(x)))
        return jnp.sum(y) / sum(sizes), y.shape[0]

    (_, rows), d_ours = nnx.jit(om_flax.value_and_grad(loss, has_aux=True))(ours, x[mine])
    assert rows == sizes[RANK]
    d_ref = nnx.grad(loss, has_aux=True)(stock, x)[0]
    jax.tree.map(_close, nnx.to_pure_dict(d_ours), nnx.to_pure_dict(d_ref))


def test_applying_unsummed_gradients_warns_once_and_can_be_refused():
    from osmm_jax._src import unsummed_grads

    sizes = _row_sizes()
    tokens = jnp.asarray(np.random.default_rng(13).integers(0, 7, sum(sizes)), jnp.int32)
    ours = _DataParallel(tuple(sizes))
    params = _DataParallel().init(jax.random.key(3), tokens)
    t = tokens[_mine(sizes)]

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


def test_value_and_grad_leaves_layers_it_does_not_differentiate_to_their_own_grad():
    sizes = _row_sizes()
    tokens = jnp.asarray(np.random.default_rng(14).integers(0, 7, sum(sizes)), jnp.int32)
    mine = _mine(sizes)
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
