"""Noticing un-summed gradients (osmm_jax._src.nn.unsummed_grads), in one process.

A data-parallel layer differentiated in a model with other parameters, and no sync_grads, is
judged when the jitted function's trace ends, or (eager) at the next step; a model made only of
data-parallel layers, a step that calls sync_grads, and osmm_jax.flax.value_and_grad are never
warned about. The same checks on several ranks: tests/mpi/nn/test_flax_tensor_parallel.py.
"""

from __future__ import annotations

import warnings

import pytest

flax = pytest.importorskip("flax")
om_flax = pytest.importorskip(
    "osmm_jax.flax", exc_type=ImportError
)  # Flax new enough for the layers

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from osmm_jax._src.nn import unsummed_grads  # noqa: E402

X = jnp.arange(16.0).reshape(4, 4) / 16


class _WithNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return om_flax.Dense(3, row_sizes=[4])(nn.LayerNorm()(x)).sum()


class _OnlyDataParallel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return om_flax.Dense(3, row_sizes=[4])(om_flax.Dense(5, row_sizes=[4])(x)).sum()


class _NnxWithNorm(nnx.Module):
    def __init__(self):
        self.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
        self.dense = om_flax.Linear(4, 3, row_sizes=[4], rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.dense(self.norm(x)).sum()


class _NnxOnlyDataParallel(nnx.Module):
    def __init__(self):
        self.dense = om_flax.Linear(4, 3, row_sizes=[4], rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.dense(x).sum()


@pytest.fixture(autouse=True)
def _fresh():
    """Each test starts and ends with nothing noted and the warning not yet given."""
    unsummed_grads.reset()
    yield
    unsummed_grads.reset()


def _warnings(run) -> list[str]:
    """The UnsummedGradientsWarning messages ``run`` gives, exit included."""
    unsummed_grads.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
        unsummed_grads._at_exit()
    return [str(w.message) for w in caught if w.category is om_flax.UnsummedGradientsWarning]


def _linen(model):
    return model, model.init(jax.random.key(0), X)


def test_jitted_linen_step_without_sync_is_named_when_traced():
    model, params = _linen(_WithNorm())
    messages = _warnings(lambda: jax.jit(jax.grad(lambda p: model.apply(p, X)))(params))
    assert len(messages) == 1
    assert "'LayerNorm_0/bias', 'LayerNorm_0/scale'" in messages[0]
    assert "sync_grads" in messages[0] and "value_and_grad" in messages[0]


def test_eager_linen_steps_without_sync_are_noticed_at_the_next_step():
    model, params = _linen(_WithNorm())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.grad(lambda p: model.apply(p, X))(params)
        assert caught == []  # the step may still call sync_grads
        jax.grad(lambda p: model.apply(p, X))(params)
        assert [w.category for w in caught] == [om_flax.UnsummedGradientsWarning]


def test_summed_steps_and_models_of_data_parallel_layers_only_are_not_warned_about():
    model, params = _linen(_WithNorm())
    only, only_params = _linen(_OnlyDataParallel())
    skip = om_flax.summed_paths(model, X)

    def run():
        jax.jit(lambda p: om_flax.sync_grads(jax.grad(lambda p: model.apply(p, X))(p), skip))(
            params
        )
        jax.jit(om_flax.grad(lambda p: model.apply(p, X)))(params)
        om_flax.value_and_grad(lambda p: model.apply(p, X))(params)  # eager
        jax.jit(jax.grad(lambda p: only.apply(p, X)))(only_params)
        jax.jit(lambda p: model.apply(p, X))(params)  # not differentiated

    assert _warnings(run) == []


def test_nnx_models_are_judged_by_their_own_parameters():
    with_norm, only = _NnxWithNorm(), _NnxOnlyDataParallel()

    def step(m):
        return nnx.grad(lambda m: m(X))(m)

    messages = _warnings(lambda: nnx.jit(step)(with_norm))
    assert len(messages) == 1 and "'norm/bias', 'norm/scale'" in messages[0]
    assert _warnings(lambda: nnx.jit(step)(only)) == []
    assert (
        _warnings(lambda: nnx.jit(lambda m: om_flax.value_and_grad(lambda m: m(X))(m))(with_norm))
        == []
    )
    assert _warnings(lambda: nnx.jit(lambda m: om_flax.sync_grads(step(m), m))(with_norm)) == []


def test_the_warning_can_refuse_the_step():
    model, params = _linen(_WithNorm())
    with warnings.catch_warnings():
        warnings.simplefilter("error", om_flax.UnsummedGradientsWarning)
        with pytest.raises(om_flax.UnsummedGradientsWarning):
            jax.jit(jax.grad(lambda p: model.apply(p, X)))(params)


def test_value_and_grad_on_one_rank_equals_jax():
    model, params = _linen(_WithNorm())
    value, grads = jax.jit(om_flax.value_and_grad(lambda p: model.apply(p, X)))(params)
    ref_value, ref = jax.value_and_grad(lambda p: model.apply(p, X))(params)
    assert float(value) == pytest.approx(float(ref_value))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    with pytest.raises(ValueError, match="argnums 2 names argument 2"):
        om_flax.value_and_grad(lambda p, x: model.apply(p, x), argnums=2)(params, X)


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(om_flax.Dense)(3, row_sizes=[4])(nn.LayerNorm()(x)).sum()


def test_a_step_through_remat_is_judged_too():
    model, params = _linen(_Remat())
    messages = _warnings(lambda: jax.jit(jax.grad(lambda p: model.apply(p, X)))(params))
    assert len(messages) == 1 and "'LayerNorm_0/bias'" in messages[0]


def test_value_and_grad_refuses_what_it_cannot_place_rather_than_summing_twice():
    remat, remat_params = _linen(_Remat())
    with pytest.raises(ValueError, match="through a transformation"):
        jax.jit(om_flax.grad(lambda p: remat.apply(p, X)))(remat_params)
    model, params = _linen(_WithNorm())

    def cast(p):
        return model.apply(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), X)

    with pytest.raises(ValueError, match="dtype cast"):
        om_flax.grad(cast)(params)
    # The sync_grads route works there.
    skip = om_flax.summed_paths(remat, X)
    grads = jax.jit(lambda p: om_flax.sync_grads(jax.grad(lambda p: remat.apply(p, X))(p), skip))(
        remat_params
    )
    assert set(grads["params"]) == {"LayerNorm_0", "CheckpointDense_0"}


def test_value_and_grad_refuses_tensor_parallel_layers_on_its_own_communicator():
    class _Tensor(nn.Module):
        @nn.compact
        def __call__(self, x):
            return om_flax.ColumnParallelDense(3, sizes=[3])(nn.LayerNorm()(x)).sum()

    model, params = _linen(_Tensor())
    with pytest.raises(ValueError, match="tensor-parallel layer"):
        jax.jit(om_flax.grad(lambda p: model.apply(p, X)))(params)

    class _NnxTensor(nnx.Module):
        def __init__(self):
            self.dense = om_flax.ColumnParallelLinear(4, 3, sizes=[3], rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.dense(x).sum()

    with pytest.raises(ValueError, match="tensor-parallel layer"):
        om_flax.grad(lambda m: m(X))(_NnxTensor())
    with pytest.raises(ValueError, match="either nnx modules or pytrees"):
        om_flax.grad(lambda m, p: m(X), argnums=(0, 1))(_NnxTensor(), params)


def test_a_refused_step_is_refused_again_and_points_at_the_caller():
    model, params = _linen(_WithNorm())
    step = jax.jit(jax.grad(lambda p: model.apply(p, X)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", om_flax.UnsummedGradientsWarning)
        for _ in range(2):
            with pytest.raises(om_flax.UnsummedGradientsWarning):
                step(params)
    unsummed_grads.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(jax.grad(lambda p: model.apply(p, X)))(params)
    assert [w.filename for w in caught] == [__file__]


def test_frozen_parameters_are_not_named():
    # Only the data-parallel layer is trained: the LayerNorm's gradient is never applied, so a
    # step without sync_grads is right and nothing is said.
    only_dense = nnx.All(nnx.Param, nnx.PathContains("dense"))
    messages = _warnings(
        lambda: nnx.jit(
            lambda m: nnx.grad(lambda m: m(X), argnums=nnx.DiffState(0, only_dense))(m)
        )(_NnxWithNorm())
    )
    assert messages == []
    model, params = _linen(_WithNorm())
    norm = params["params"]["LayerNorm_0"]

    def dense_only(dense):
        return model.apply({"params": {"LayerNorm_0": norm, "Dense_0": dense}}, X)

    assert _warnings(lambda: jax.jit(jax.grad(dense_only))(params["params"]["Dense_0"])) == []


@pytest.mark.parametrize(
    "split, batch_sizes, kind, completed",
    [
        ("column", None, "tensor_parallel", ()),  # each shard's gradient is this rank's own
        ("column", [4], "sequence_parallel", ("kernel", "bias")),
        ("row", [4], "sequence_parallel", ("kernel",)),  # the bias: this rank's rows' alone
    ],
)
def test_tensor_parallel_layers_report_their_communicator_and_what_they_complete(
    split, batch_sizes, kind, completed
):
    from osmm_jax._src.nn.tensor_parallel import TensorParallelDot

    comm = object()
    dot = TensorParallelDot(split, [4], comm=comm, batch_sizes=batch_sizes)
    reported, returned = [], []

    def loss(kernel, bias):
        with unsummed_grads.collecting(lambda *report: reported.append(report)):
            params = {"kernel": kernel, "bias": bias}
            got = unsummed_grads.note_tensor_parallel(dot, kernel, bias)
            returned.append(tuple(name for name, p in params.items() for g in got if g is p))
        return jnp.sum(kernel) + jnp.sum(bias)

    jax.grad(loss)(jnp.ones((4, 4)), jnp.ones(4))
    assert reported == [(kind, comm)]
    assert returned == [completed]
    # Not differentiated: nothing to report; what the product completes all the same.
    reported.clear()
    with unsummed_grads.collecting(lambda *report: reported.append(report)):
        got = unsummed_grads.note_tensor_parallel(dot, jnp.ones((4, 4)), None)
    assert reported == [] and len(got) == len(completed)
