"""Pictures of layouts and plans: one rectangle per block, the right byte matrix, no pyplot state."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
from fresh_process import modules_loaded_by

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from osmm_jax._src.planning.layout import Layout  # noqa: E402
from osmm_jax._src.planning.plan import Plan  # noqa: E402
from osmm_jax._src.planning.plot import (  # noqa: E402
    REPLICATED_HATCH,
    format_bytes,
    plot_layout,
    plot_plan,
    rank_colors,
    transfer_matrix,
)

KINDS = ("rows", "cols", "grid", "replicated")
M, K, N = 12, 10, 14

# Uneven weights per rank count; with 3 and 4 ranks one rank gets nothing (an empty block).
WEIGHTS = {1: [1.0], 2: [1.0, 3.0], 3: [2.0, 0.0, 1.0], 4: [3.0, 1.0, 0.0, 2.0]}
GRIDS = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}


def make_layout(kind: str, shape, nranks: int) -> Layout:
    weights = WEIGHTS[nranks]
    if kind == "rows":
        return Layout.rows(shape, weights=weights)
    if kind == "cols":
        return Layout.cols(shape, weights=weights)
    if kind == "replicated":
        return Layout.replicated(shape, nranks=nranks)
    pr, pc = GRIDS[nranks]
    row_w = [1.0, 2.0][:pr]
    col_w = [0.0, 1.0] if pc == 2 else WEIGHTS[pc]  # 2x2: the first grid column is empty
    return Layout.grid(shape, (pr, pc), row_weights=row_w, col_weights=col_w)


# Every combination of kinds for A, B and C; the rank counts cycle through 1..4.
CASES = [(kinds, 1 + i % 4) for i, kinds in enumerate(itertools.product(KINDS, KINDS, KINDS))]


def make_plan(kinds, nranks: int) -> Plan:
    a_kind, b_kind, c_kind = kinds
    return Plan(
        make_layout(a_kind, (M, K), nranks),
        make_layout(b_kind, (K, N), nranks),
        make_layout(c_kind, (M, N), nranks),
    )


def expected_bytes(plan: Plan, input_itemsize: int = 4, accum_itemsize: int = 4) -> np.ndarray:
    """Sender x receiver bytes, straight from the transfers: a get moves data from owner to getter."""
    out = np.zeros((plan.nranks, plan.nranks), dtype=np.int64)
    for t in plan.transfers:
        if t.op == "get":
            out[t.target, t.origin] += t.elements * input_itemsize
        else:
            out[t.origin, t.target] += t.elements * accum_itemsize
    return out


def panels(fig) -> dict:
    return {ax.get_label(): ax for ax in fig.axes}


def rectangles(ax) -> list[tuple[float, float, float, float]]:
    return sorted((p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in ax.patches)


def check_layout_panel(ax, layout: Layout) -> None:
    if layout.is_replicated:
        (patch,) = ax.patches
        rows, cols = layout.shape
        assert (patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()) == (
            0,
            0,
            cols,
            rows,
        )
        assert patch.get_hatch() == REPLICATED_HATCH
        assert any("replicated" in t.get_text() for t in ax.texts)
        return
    colors = rank_colors(layout.nranks)
    expected, empty = [], []
    for r, ((r0, r1), (c0, c1)) in enumerate(layout.blocks):
        if r1 > r0 and c1 > c0:
            expected.append(((c0, r0, c1 - c0, r1 - r0), tuple(colors[r])))
        else:
            empty.append(r)
    drawn = [
        ((p.get_x(), p.get_y(), p.get_width(), p.get_height()), tuple(p.get_facecolor()))
        for p in ax.patches
    ]
    assert sorted(drawn) == sorted(expected)
    if empty:
        assert "empty: rank" in ax.get_title()
        assert ax.get_title().endswith(", ".join(map(str, empty)))
    else:
        assert "empty" not in ax.get_title()


@pytest.fixture(autouse=True)
def no_pyplot_figures():
    """plot_plan and plot_layout build Figures directly: pyplot must hold none afterwards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before == []


@pytest.mark.parametrize(("kinds", "nranks"), CASES, ids=[f"{'-'.join(k)}-{n}" for k, n in CASES])
def test_plot_plan_draws_every_tiling_and_the_byte_matrix(kinds, nranks):
    plan = make_plan(kinds, nranks)
    fig = plot_plan(plan)
    assert isinstance(fig, Figure)
    axes = panels(fig)
    assert set(axes) == {"A", "B", "C", "transfers"}
    for name, layout in (("A", plan.a), ("B", plan.b), ("C", plan.c)):
        check_layout_panel(axes[name], layout)

    (image,) = axes["transfers"].images
    data = np.asarray(image.get_array())
    np.testing.assert_array_equal(data, expected_bytes(plan))
    np.testing.assert_array_equal(data.sum(axis=1), plan.bytes_sent())
    texts = [t.get_text() for t in axes["transfers"].texts]
    if data.any():
        assert sorted(texts) == sorted(format_bytes(v) for v in data.ravel() if v)
    else:
        assert texts == ["no communication"]

    title = fig.get_suptitle()
    assert f"A[{M}×{K}]" in title and f"B[{K}×{N}]" in title and f"C[{M}×{N}]" in title
    assert f"{sum(plan.flops) / 1e9:.3g} GFLOP" in title
    assert format_bytes(sum(plan.bytes_sent())) in title
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [label.split(":")[0] for label in labels[:nranks]] == [
        f"rank {r}" for r in range(nranks)
    ]
    replicated = any(lay.is_replicated for lay in (plan.a, plan.b, plan.c))
    assert labels[nranks:] == (["replicated"] if replicated else [])


def test_figures_render_to_png():
    plan = make_plan(("rows", "cols", "grid"), 4)
    for fig in (plot_plan(plan), plot_layout(plan.c)):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=40)
        assert buffer.getvalue().startswith(b"\x89PNG")


def test_degenerate_shapes_still_draw():
    # A matrix with no rows: every block is empty, nothing is sent.
    plan = Plan(
        Layout.rows((0, 5), nranks=2), Layout.cols((5, 3), nranks=2), Layout.rows((0, 3), nranks=2)
    )
    axes = panels(plot_plan(plan))
    assert len(axes["A"].patches) == 0 and "empty: ranks 0, 1" in axes["A"].get_title()
    assert len(axes["B"].patches) == 2
    assert axes["A"].get_xlim() == (0, 5) and axes["A"].get_ylim() == (1, 0)


def test_byte_matrix_for_other_dtypes():
    plan = make_plan(("rows", "cols", "grid"), 4)
    for input_itemsize, accum_itemsize in ((2, 4), (8, 8)):
        sent = transfer_matrix(plan, input_itemsize, accum_itemsize)
        np.testing.assert_array_equal(sent, expected_bytes(plan, input_itemsize, accum_itemsize))
        np.testing.assert_array_equal(
            sent.sum(axis=1), plan.bytes_sent(input_itemsize, accum_itemsize)
        )
        assert not np.diag(sent).any()
    fig = plot_plan(plan, input_itemsize=2)
    np.testing.assert_array_equal(
        panels(fig)["transfers"].images[0].get_array(), transfer_matrix(plan, 2, 4)
    )
    assert "float32" not in panels(fig)["transfers"].get_title()


def test_plot_layout_on_given_axes_and_alone():
    layout = Layout.rows((12, 4), weights=WEIGHTS[4])
    fig = plot_layout(layout)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    check_layout_panel(fig.axes[0], layout)

    mine = Figure()
    left, right = mine.subfigures(1, 2)
    ax = right.add_subplot()
    assert plot_layout(layout, ax=ax, title="batch rows") is mine
    assert ax.get_title().startswith("batch rows")
    check_layout_panel(ax, layout)
    assert plot_plan(make_plan(("rows", "rows", "rows"), 2), fig=left) is left


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="osmm_jax.Plan"):
        plot_plan(Layout.rows((4, 4), nranks=2))
    with pytest.raises(ValueError, match="either fig or figsize"):
        plot_plan(make_plan(("rows", "rows", "rows"), 2), fig=Figure(), figsize=(3, 3))


def test_rank_colors_and_byte_units():
    for n in (1, 4, 10, 12, 20, 33):
        colors = rank_colors(n)
        assert len(colors) == n and len(set(colors)) == n
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**20) == "3 MiB"
    assert format_bytes(5 * 2**30) == "5 GiB"


def test_importing_the_module_loads_no_matplotlib_jax_or_mpi():
    code = "import osmm_jax._src.planning.plot"
    assert not modules_loaded_by(code, ("matplotlib", "jax", "mpi4py"))


# -- the pure steps, one at a time ------------------------------------------------------------


def test_block_bounds_and_empty_ranks():
    from osmm_jax._src.planning.plot import _block_bounds, _empty_note

    layout = Layout.rows((12, 10), weights=[2.0, 0.0, 1.0])
    x_bounds, y_bounds, empty = _block_bounds(layout)
    assert (x_bounds, y_bounds, empty) == ({0, 10}, {0, 8, 12}, [1])
    assert _empty_note(empty) == "\nempty: rank 1"
    assert _empty_note([0, 2]) == "\nempty: ranks 0, 2"
    assert _empty_note([]) == ""


def test_plan_title_and_legend_labels():
    from osmm_jax._src.planning.plot import _flops_label, _plan_title

    plan = make_plan(("rows", "replicated", "rows"), 2)
    title = _plan_title(plan, 3 * 2**20)
    assert title.startswith(f"C[{M}×{N}] = A[{M}×{K}] @ B[{K}×{N}] over 2 ranks: ")
    assert title.endswith(f"{2 * M * K * N / 1e9:.3g} GFLOP, 3 MiB sent")
    assert _flops_label(1, 3_000_000_000, 4_000_000_000) == "rank 1: 3 GFLOP (75%)"
    assert _flops_label(0, 0, 0) == "rank 0: 0 GFLOP"


def test_plan_figure_is_the_given_one_or_new():
    from osmm_jax._src.planning.plot import _plan_figure

    fig = Figure()
    assert _plan_figure(fig, None) is fig
    assert tuple(_plan_figure(None, (6.0, 2.0)).get_size_inches()) == (6.0, 2.0)
    with pytest.raises(ValueError, match="not both"):
        _plan_figure(fig, (6.0, 2.0))
