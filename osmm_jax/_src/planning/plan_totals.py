"""A plan's per-rank flops and bytes without its records: what a cost model needs.

:func:`osmm_jax.auto_layouts` prices many candidate layouts by every rank's flops and the bytes
it sends and receives, exactly as the plan of each would have them. :class:`PlanTotals` gives
those figures without making any record: for the layouts of the candidate strategies by
counting in bulk (:mod:`osmm_jax._src.planning.family_totals`), for any other from the
decisions of the cells alone (:func:`~osmm_jax._src.planning.totals.schedule_totals`).

Pure Python and numpy; imports neither JAX nor MPI.
"""

from __future__ import annotations

from osmm_jax._src.planning.cells import check_layouts, check_work
from osmm_jax._src.planning.family_totals import family_totals
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, totals_as_run
from osmm_jax._src.planning.records import FLOAT32_BYTES
from osmm_jax._src.planning.work import Work


class PlanTotals:
    """The per-rank figures of ``Plan(a, b, c)`` that a cost model needs, without its records.

    ``flops``, :meth:`bytes_sent` and :meth:`bytes_issued` equal the plan's own, and
    :meth:`bytes_received` is what the plan's transfers bring to each rank; the multiplies and
    transfers are never made, so trying many candidate layouts (:func:`osmm_jax.auto_layouts`)
    costs the server decisions alone, and for the layouts of its candidate strategies not even
    those one by one (:mod:`osmm_jax._src.planning.family_totals`).
    """

    def __init__(self, a: Layout, b: Layout, c: Layout, work: Work | None = None):
        check_layouts(a, b, c)
        check_work(work, a, b)
        self.nranks = a.nranks
        totals = family_totals(a, b, c, work)
        if totals is None:
            totals = totals_as_run(Plan(a, b, c, work=work))
        self.totals = totals
        self.flops = totals.flops
        self._inputs, self._partials = totals.inputs, totals.partials

    def bytes_sent(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_sent`."""
        return tuple(
            i * input_itemsize + p * accum_itemsize for i, p in zip(self._inputs, self._partials)
        )

    def bytes_received(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_received`."""
        t = self.totals
        return tuple(
            i * input_itemsize + p * accum_itemsize
            for i, p in zip(t.received_inputs, t.received_partials)
        )

    link_bytes = Plan.link_bytes  # the same rule, over these totals' sent and received bytes

    def bytes_issued(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_issued`: the pieces each rank gets and the partials it
        delivers (what :func:`osmm_jax._src.planning.comm_bound.moved_elements` counts)."""
        t = self.totals
        return tuple(
            i * input_itemsize + p * accum_itemsize for i, p in zip(t.received_inputs, t.partials)
        )
