"""Neural-network layers built on distributed products: the Flax layers behind
``osmm_jax.flax``.

The data-parallel dot (``distributed_dot``), the tensor- and sequence-parallel linear layers
(``tensor_parallel``) and the bookkeeping of which gradients still need summing over ranks
(``unsummed_grads``), with their linen and nnx front ends. ``osmm_jax.flax`` keeps the public
names and re-exports them. It may import ``runtime``, ``planning`` and the base modules; Flax
itself is imported lazily, so the rest of osmm_jax works without it.
"""
