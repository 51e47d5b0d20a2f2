"""Tuning: measuring ranks and adapting to what is measured.

Per-rank GEMM speed profiling (``speeds``), rebalancing a split as step times come in
(``rebalance``), and choosing between the one_sided and allreduce methods by measurement
(``fallback``). It may import ``runtime``, ``planning`` and the base modules, never ``nn``.
"""
