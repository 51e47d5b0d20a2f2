"""Runtime: what runs a planned product on the ranks of an MPI job.

``matmul`` and its differentiation and batching rules, the two executors (``one_sided``: RMA
through the native handlers; ``allreduce``: the all-reduce baseline), the primitives that lower
to XLA FFI custom calls (``primitives``), the bridge to the native extension (``native``,
which also holds the built ``_osmm_ffi`` modules), private communicators and the all-ranks
agreement (``communicators``), what a product will move and hold (``prediction``), result checksums, the watchdog's settings, the public
``plan``/``gather``/``stats`` entry points (``api``) and the counters behind them
(``metrics``). It may import ``planning`` and the base modules, never ``nn`` or ``tuning``.
"""
