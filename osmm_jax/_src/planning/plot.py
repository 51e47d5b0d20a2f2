"""Pictures of layouts and plans: who owns which block, who sends how many bytes to whom.

:func:`plot_plan` draws the tilings of A, B and C side by side (each block a
rectangle coloured by the rank that owns it; a replicated matrix as one hatched
rectangle; empty blocks listed under the panel's title) and a P x P heatmap of
the bytes each rank sends to each other rank, from the plan's transfers: a
``get`` counts from the owner of the piece to the rank that gets it, an
``accumulate`` or ``put`` from the rank that computed the partial to the owner
of the C block. :func:`plot_layout` draws one layout alone.

Figures are built with :class:`matplotlib.figure.Figure`, never through
pyplot, so they work headless (no display, any backend) and leave no global
figure state behind; in Jupyter they display after ``%matplotlib inline``.
Matplotlib is imported only when a picture is drawn (``pip install
osmm_jax[plot]``). Pure host-side: no JAX, no MPI.

Plans are arguments here, never imports: :meth:`Plan.plot` calls :func:`plot_plan`, so this
module depends only on the modules below the plan's (its records and totals).
"""

from __future__ import annotations

import numpy as np

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.records import FLOAT32_BYTES
from osmm_jax._src.planning.totals import per_rank_totals
from osmm_jax._src.units import format_bytes

REPLICATED_HATCH = "//"
"""Hatch pattern of a replicated matrix."""

_ANNOTATE_MAX_RANKS = 12
"""Heatmap cells are annotated with their byte counts up to this many ranks."""

_LABEL_MIN_FRACTION = 0.05
"""A block is labelled with its rank when both its sides are at least this fraction of the matrix."""

_PLAN_INTERFACE = ("dims", "nranks", "flops", "transfers", "for_rank")
"""What the class of a :class:`~osmm_jax.Plan` has and :func:`plot_plan` checks for: this module
takes plans as arguments without importing their class."""


def transfer_matrix(
    plan, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
) -> np.ndarray:
    """Bytes rank ``s`` sends to rank ``d`` for one product, as an int64 array of shape ``(P, P)``.

    Entry ``[s, d]`` sums, over the plan's transfers, the bytes leaving ``s``'s
    memory for ``d``: A/B pieces that ``d`` gets from ``s`` (``input_itemsize``
    bytes per element) and C partials that ``s`` accumulates or puts into
    ``d``'s block (``accum_itemsize`` bytes per element: 4 for float32,
    bfloat16 and float16, 8 for float64). The diagonal is zero; row sums equal
    :meth:`Plan.bytes_sent`.
    """
    table = per_rank_totals(
        plan.transfers,
        plan.nranks,
        ("sender", "receiver"),
        lambda t: t.nbytes(input_itemsize, accum_itemsize),
    )
    return np.array(table, dtype=np.int64).reshape(plan.nranks, plan.nranks)


def rank_colors(nranks: int) -> list:
    """One RGBA colour per rank, distinct for up to 20 ranks (qualitative maps), then cycling hues."""
    from matplotlib import colormaps

    if nranks <= 10:
        cmap = colormaps["tab10"]
        return [cmap(r) for r in range(nranks)]
    if nranks <= 20:
        cmap = colormaps["tab20"]
        return [cmap(r) for r in range(nranks)]
    cmap = colormaps["hsv"]
    return [cmap(r / nranks) for r in range(nranks)]


def plot_layout(layout: Layout, ax=None, *, title: str | None = None, colors=None):
    """Draw ``layout``'s tiling of its matrix on ``ax``; returns the Figure that holds it.

    Columns run left to right and rows top to bottom, in global indices; ticks
    mark the block boundaries (when there are few). Each non-empty block is one
    rectangle in its rank's colour, labelled with the rank when large enough; a
    replicated layout is one hatched rectangle labelled "replicated"; ranks with
    empty blocks are listed under the title.

    Args:
        layout: the :class:`~osmm_jax.Layout` to draw.
        ax: a Matplotlib Axes to draw on; None makes a new Figure with one.
        title: the panel title (default: the layout's shape and kind).
        colors: one colour per rank (default :func:`rank_colors`).
    """
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=(4.0, 4.0), layout="constrained").add_subplot()
    if colors is None:
        colors = rank_colors(layout.nranks)
    _draw_layout(ax, layout, title, colors)
    return _root_figure(ax)


def plot_plan(
    plan,
    *,
    fig=None,
    figsize: tuple[float, float] | None = None,
    input_itemsize: int = FLOAT32_BYTES,
    accum_itemsize: int = FLOAT32_BYTES,
):
    """Draw ``plan``: the A, B and C tilings and the bytes each rank sends to each other rank.

    Four panels in one row, labelled ``"A"``, ``"B"``, ``"C"`` and
    ``"transfers"`` (``Axes.get_label()``). The tilings are drawn as by
    :func:`plot_layout`, with one legend for all three giving each rank's colour
    and its share of the flops. The heatmap's entry (sender ``s``, receiver
    ``d``) is :func:`transfer_matrix`'s, annotated in B/KiB/MiB/GiB; each
    sender's total is on its tick label. The title gives M x K x N, the total
    flops and the total bytes sent.

    Args:
        plan: the :class:`~osmm_jax.Plan` to draw (from ``osmm_jax.plan`` or
            ``Plan(a, b, c)``: no MPI is needed).
        fig: a Matplotlib Figure or SubFigure to draw into (default: a new Figure).
        figsize: ``(width, height)`` in inches of the new Figure (default
            ``(17, 4.8)``); only without ``fig``.
        input_itemsize, accum_itemsize: bytes per element of A/B pieces and of C
            partials (default 4: float32; see :meth:`Plan.bytes_sent`).

    Returns:
        The :class:`matplotlib.figure.Figure` drawn (``fig`` itself, if given).
    """
    if not all(hasattr(type(plan), name) for name in _PLAN_INTERFACE):
        raise TypeError(f"plan must be an osmm_jax.Plan, got {type(plan).__name__}")
    fig = _plan_figure(fig, figsize)
    colors = rank_colors(plan.nranks)
    sent = transfer_matrix(plan, input_itemsize, accum_itemsize)
    fig.suptitle(_plan_title(plan, int(sent.sum())))
    axes = fig.subplots(1, 4, width_ratios=[1, 1, 1, 1.1])
    _draw_tilings(axes[:3], plan, colors)
    axes[3].set_label("transfers")
    _draw_transfers(axes[3], sent, input_itemsize == accum_itemsize == FLOAT32_BYTES)
    handles = _legend_handles(plan, colors)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6))
    return fig


def _plan_figure(fig, figsize):
    """``fig``, or a new constrained-layout Figure of ``figsize`` inches (default 17 x 4.8)."""
    if fig is None:
        from matplotlib.figure import Figure

        return Figure(figsize=figsize or (17.0, 4.8), layout="constrained")
    if figsize is not None:
        raise ValueError("give either fig or figsize, not both")
    return fig


def _plan_title(plan, sent_bytes: int) -> str:
    """The product's shape, ranks, total GFLOP and total bytes sent, in one line."""
    M, K, N = plan.dims
    return (
        f"C[{M}×{N}] = A[{M}×{K}] @ B[{K}×{N}] over {plan.nranks} ranks: "
        f"{sum(plan.flops) / 1e9:.3g} GFLOP, {format_bytes(sent_bytes)} sent"
    )


def _draw_tilings(axes, plan, colors) -> None:
    """Draw A, B and C on the three ``axes``, labelled ``"A"``, ``"B"``, ``"C"``."""
    for ax, name, layout, dims in (
        (axes[0], "A", plan.a, "M×K"),
        (axes[1], "B", plan.b, "K×N"),
        (axes[2], "C", plan.c, "M×N"),
    ):
        rows, cols = layout.shape
        ax.set_label(name)
        _draw_layout(ax, layout, f"{name} ({dims} = {rows}×{cols}), {layout.kind}", colors)


def _flops_label(rank: int, flops: int, total_flops: int) -> str:
    """A rank's legend entry: its GFLOP and, when there is work, its share of the total."""
    share = f" ({flops / total_flops:.0%})" if total_flops else ""
    return f"rank {rank}: {flops / 1e9:.3g} GFLOP{share}"


def _legend_handles(plan, colors) -> list:
    """One patch per rank (colour, GFLOP, share), and the replicated hatch when one is drawn."""
    from matplotlib.patches import Patch

    total_flops = sum(plan.flops)
    handles = [
        Patch(facecolor=colors[r], label=_flops_label(r, plan.flops[r], total_flops))
        for r in range(plan.nranks)
    ]
    if any(lay.is_replicated for lay in (plan.a, plan.b, plan.c)):
        handles.append(
            Patch(facecolor="0.9", edgecolor="0.3", hatch=REPLICATED_HATCH, label="replicated")
        )
    return handles


def _root_figure(ax):
    """The top-level Figure of ``ax`` (not a SubFigure), on old and new Matplotlib."""
    try:
        return ax.get_figure(root=True)
    except TypeError:  # Matplotlib < 3.10
        return ax.figure.figure


def _draw_layout(ax, layout: Layout, title: str | None, colors) -> None:
    """Draw ``layout``'s tiling on ``ax`` (see :func:`plot_layout`), titled ``title``.

    ``title`` None: the shape, kind and rank count. Ranks with empty blocks are
    listed under the title.
    """
    rows, cols = layout.shape
    if title is None:
        title = f"{rows}×{cols}, {layout.kind}, {layout.nranks} ranks"
    width, height = _frame(ax, rows, cols)
    if layout.is_replicated:
        _draw_replicated(ax, layout, width, height)
        x_bounds, y_bounds, empty = {0, cols}, {0, rows}, []
    else:
        x_bounds, y_bounds, empty = _block_bounds(layout)
        for r, block in enumerate(layout.blocks):
            if r not in empty:
                _draw_block(ax, r, block, colors[r], width, height)
    _boundary_ticks(ax, x_bounds, y_bounds)
    ax.set_title(title + _empty_note(empty), fontsize=10)


def _frame(ax, rows: int, cols: int) -> tuple[int, int]:
    """Set ``ax`` up for a ``rows`` x ``cols`` matrix, row 0 on top; returns (width, height).

    Width and height are in elements, at least 1, since Axes need a positive
    extent even for a matrix with no rows or no columns. The aspect is equal
    unless the matrix is more than 4 times longer one way than the other.
    """
    width, height = max(cols, 1), max(rows, 1)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ratio = max(width, height) / min(width, height)
    ax.set_aspect("equal" if ratio <= 4 else "auto")
    ax.tick_params(labelsize=8)
    return width, height


def _draw_replicated(ax, layout: Layout, width: int, height: int) -> None:
    """A replicated matrix: one hatched rectangle, labelled with the number of ranks."""
    from matplotlib.patches import Rectangle

    rows, cols = layout.shape
    ax.add_patch(
        Rectangle(
            (0, 0),
            cols,
            rows,
            facecolor="0.9",
            edgecolor="0.3",
            hatch=REPLICATED_HATCH,
            linewidth=1.0,
        )
    )
    ax.text(
        width / 2,
        height / 2,
        f"replicated\non all {layout.nranks} ranks",
        ha="center",
        va="center",
        fontsize=9,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


def _block_bounds(layout: Layout) -> tuple[set, set, list[int]]:
    """The block edges along columns and along rows (global indices), and the empty ranks.

    The edges include the matrix's own (0 and its size); ranks whose blocks hold
    no element add no edges.
    """
    rows, cols = layout.shape
    x_bounds, y_bounds, empty = {0, cols}, {0, rows}, []
    for r, ((r0, r1), (c0, c1)) in enumerate(layout.blocks):
        if r1 == r0 or c1 == c0:
            empty.append(r)
        else:
            x_bounds.update((c0, c1))
            y_bounds.update((r0, r1))
    return x_bounds, y_bounds, empty


def _draw_block(ax, rank: int, block, color, width: int, height: int) -> None:
    """One rank's block as a rectangle in its colour, labelled with the rank when large enough.

    ``block`` is ``((r0, r1), (c0, c1))`` in global indices; the label needs both
    sides to be at least ``_LABEL_MIN_FRACTION`` of the matrix (``width`` x ``height``).
    """
    from matplotlib.patches import Rectangle

    (r0, r1), (c0, c1) = block
    ax.add_patch(
        Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="white", linewidth=1.5)
    )
    if (c1 - c0) >= _LABEL_MIN_FRACTION * width and (r1 - r0) >= _LABEL_MIN_FRACTION * height:
        ax.text(
            (c0 + c1) / 2,
            (r0 + r1) / 2,
            str(rank),
            ha="center",
            va="center",
            fontsize=10,
            color="white",
            fontweight="bold",
        )


def _empty_note(empty: list[int]) -> str:
    """The line listing ranks with empty blocks, to go under a title; empty when none."""
    if not empty:
        return ""
    which = "rank" if len(empty) == 1 else "ranks"
    return f"\nempty: {which} {', '.join(map(str, empty))}"


def _boundary_ticks(ax, x_bounds, y_bounds, most: int = 9) -> None:
    """Ticks at the block boundaries when there are at most ``most`` per axis."""
    if len(x_bounds) <= most:
        ax.set_xticks(sorted(x_bounds))
    if len(y_bounds) <= most:
        ax.set_yticks(sorted(y_bounds))


def _draw_transfers(ax, sent: np.ndarray, float32: bool) -> None:
    nranks = sent.shape[0]
    peak = int(sent.max()) if sent.size else 0
    image = ax.imshow(sent, cmap="Blues", vmin=0, vmax=max(peak, 1), interpolation="nearest")
    ax.set_xticks(range(nranks))
    ax.set_yticks(
        range(nranks), [f"{s}: {format_bytes(int(sent[s].sum()))}" for s in range(nranks)]
    )
    ax.tick_params(labelsize=8)
    ax.set_xlabel("receiver rank")
    ax.set_ylabel("sender rank: total sent")
    ax.set_title("bytes sent per product" + (" (float32)" if float32 else ""), fontsize=10)
    if peak == 0:
        ax.text(
            (nranks - 1) / 2,
            (nranks - 1) / 2,
            "no communication",
            ha="center",
            va="center",
            fontsize=10,
            bbox={"facecolor": "white", "edgecolor": "0.5"},
        )
        return
    if nranks <= _ANNOTATE_MAX_RANKS:
        for s in range(nranks):
            for d in range(nranks):
                value = int(sent[s, d])
                if value:
                    dark = image.norm(value) > 0.5
                    ax.text(
                        d,
                        s,
                        format_bytes(value),
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if dark else "black",
                    )
