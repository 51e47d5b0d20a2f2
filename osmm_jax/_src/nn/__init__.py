"""Neural-network layers built on distributed products: the Flax layers behind
``osmm_jax.flax``.

* ``distributed_dot``: the data-parallel product (batch rows split, kernel replicated);
* ``tensor_parallel``: the tensor- and sequence-parallel product, and the checkpoint shards;
* ``rank_counts``: the check of the per-rank counts they take (``row_sizes``, ``sizes``,
  ``batch_sizes``);
* ``linen_layers``, ``nnx_layers``: the layers, as ``flax.linen`` and ``flax.nnx`` modules;
* ``grad_summing``: summing the gradients the products do not (``sync_grads``,
  ``value_and_grad``, ``grad``, ``summed_paths``);
* ``unsummed_grads``, ``param_paths``: noticing a step that leaves gradients un-summed, and
  the parameter paths it names.

``osmm_jax.flax`` keeps the public names and re-exports them. This package may import
``runtime``, ``planning`` and the base modules. Flax is imported only by ``linen_layers``,
``nnx_layers`` and ``grad_summing``, which only ``osmm_jax.flax`` imports, so the rest of
osmm_jax works without it.
"""
