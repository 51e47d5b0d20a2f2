"""Planning: which rank multiplies which sub-blocks of a product, and where the results go.

Layouts of A, B and C (``layout``), optional work splits (``work``), the planner that cuts a
product into cells and decides who computes each (``cells``), schedules them as records
(multiplies, gets, deliveries: ``records``, ``schedule``) and holds them in a ``plan``, the
totals and lower bounds that price a plan (``totals``, ``plan_totals``, ``family_totals``,
``comm_bound``), the choice of layouts (``auto_layout``), speed-proportional splits
(``balance``), and plans in words and pictures (``describe``, ``plot``).
Pure Python and deterministic, identical on every rank: it may import only the base modules
of ``osmm_jax._src`` (config, log, checks, units, dtypes), numpy and, lazily, matplotlib;
never JAX, MPI or the other layers (checked by ``make lint``).
"""
