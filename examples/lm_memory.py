"""Memory estimates of the language model of ``examples/train_lm.py``, and splits within budgets.

``train_lm.py --budgets`` gives each rank a memory budget (bytes); this module estimates what
the model costs each rank and asks :func:`osmm_jax.balance` for a split by speed that fits.
Every figure is in bytes and counts float32 values (4 bytes each): the parameters with their
gradients and adam's two moments (4 copies), and the activations the backward pass keeps.
Not counted: the Python and JAX runtime, XLA's compiled code and temporaries, and osmm_jax's
MPI windows, which a process holds whatever its share (the peaks ``train_lm.py`` prints at the
end include them).

The model (see ``train_lm.py``): vocabulary ``V``, context ``T``, width ``d``, ``H`` heads of
``d / H`` features, ``L`` blocks. Per token, the backward pass keeps in each block the block's
input ``x`` and its LayerNorm (``2d``), the query, key and value (``3d``), the heads' output
before the projection (``d``), the residual after attention and its LayerNorm (``2d``), the
MLP's hidden features before and after the GELU (``8d``): ``16d``; and the attention scores
and their softmax (``2HT``: the softmax's backward needs its output, and the scores are live
while it is computed). Outside the blocks: the last residual and its LayerNorm (``2d``), the
logits and the cross-entropy's softmax (``2V``), and the int32 tokens and targets (2 values).

Nothing here is collective: every rank computes the same split from the same arguments. In
``sp`` the sequences between the layer pairs are still split by speed alone; only their
residual activations count against each rank's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import osmm_jax as om
from osmm_jax._src.config import parse_bytes  # the reader of OSMM_MEMORY_BUDGET
from osmm_jax._src.units import format_bytes

FLOAT_BYTES = 4  # float32 (and the int32 tokens)
STATE_COPIES = 4  # parameters, gradients, adam's first and second moments


@dataclass(frozen=True)
class Model:
    """The sizes that set the model's memory: vocabulary, context (characters per sequence),
    width ``d``, attention heads and Transformer blocks."""

    vocab: int
    context: int
    d: int
    heads: int
    layers: int

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


def parse_budgets(text: str):
    """``--budgets``: ``"auto"``, or bytes for every rank or one per rank, comma-separated, each
    a number with an optional binary unit (``"64MiB"``, ``"1.5GiB"``, ``"4e6"``; ``0``/``inf``/
    ``none``: no limit). Returns ``"auto"`` or a tuple of bytes (floats, ``math.inf`` allowed)."""
    if text.strip().lower() == "auto":
        return "auto"
    return tuple(parse_bytes(part, "--budgets entry") for part in text.split(","))


def parameter_count(m: Model) -> int:
    """All parameters: embeddings ``V d``, positions ``T d``, per block ``12 d^2 + 13 d`` (the
    query/key/value layer ``3 d^2 + 3 d``, the output projection ``d^2 + d``, the MLP
    ``8 d^2 + 5 d``, two LayerNorms ``4 d``), the final LayerNorm ``2 d`` and the output
    projection ``d V + V``."""
    d = m.d
    return (
        m.vocab * d
        + m.context * d
        + m.layers * (12 * d * d + 13 * d)
        + 2 * d
        + d * m.vocab
        + m.vocab
    )


def replicated_parameter_count(m: Model) -> int:
    """The parameters every rank holds whole in ``tp``/``sp``: all but the column-parallel
    kernels and biases and the row-parallel kernels (per block: two LayerNorms and the two
    row-parallel biases, ``6 d``)."""
    d = m.d
    return m.vocab * d + m.context * d + m.layers * 6 * d + 2 * d + d * m.vocab + m.vocab


def dp_fixed_bytes(m: Model) -> int:
    """Bytes every rank holds in ``dp`` whatever its share of the batch: every parameter, its
    gradient and adam's two moments (``parameters x 4 bytes x 4``)."""
    return parameter_count(m) * FLOAT_BYTES * STATE_COPIES


def _values_per_token_outside_blocks(m: Model) -> int:
    """Values kept per token outside the blocks: the last residual and its LayerNorm, the
    logits and their softmax, the token and target ids."""
    return 2 * m.d + 2 * m.vocab + 2


def dp_bytes_per_sequence(m: Model) -> int:
    """Bytes one more sequence of the batch costs a rank in ``dp``: the activations the backward
    pass keeps for its ``T`` tokens (module docstring):
    ``T x 4 x (L (16 d + 2 H T) + 2 d + 2 V + 2)``."""
    per_token = m.layers * (16 * m.d + 2 * m.heads * m.context)
    return m.context * FLOAT_BYTES * (per_token + _values_per_token_outside_blocks(m))


def tp_bytes_per_head(m: Model, batch: int) -> int:
    """Bytes one more attention head costs a rank in ``tp``/``sp`` (in every block): its columns
    of the query/key/value layer and rows of the output projection, ``(4 d + 3) d / H``
    parameters x 4 bytes x 4 copies; and, for every token of the whole batch (a
    column-parallel layer computes its heads for every sequence), its query, key, value and
    output (``4 d / H``) and its scores and softmax (``2 T``), 4 bytes each."""
    hd = m.head_dim
    params = (4 * m.d + 3) * hd * FLOAT_BYTES * STATE_COPIES
    activations = batch * m.context * (4 * hd + 2 * m.context) * FLOAT_BYTES
    return m.layers * (params + activations)


def tp_bytes_per_hidden(m: Model, batch: int) -> int:
    """Bytes one more MLP hidden feature costs a rank in ``tp``/``sp`` (in every block): its
    column of the up projection and row of the down projection, ``2 d + 1`` parameters x 4
    bytes x 4 copies; and its value before and after the GELU for every token of the batch."""
    params = (2 * m.d + 1) * FLOAT_BYTES * STATE_COPIES
    activations = batch * m.context * 2 * FLOAT_BYTES
    return m.layers * (params + activations)


def tp_fixed_bytes(m: Model, sequences: int) -> int:
    """Bytes a rank holds in ``tp``/``sp`` whatever its heads and hidden features: the
    replicated parameters (:func:`replicated_parameter_count`) x 4 bytes x 4 copies, and the
    residual-stream activations of ``sequences`` sequences (the whole batch in ``tp``, the
    rank's own in ``sp``): per token and block the residual before and after attention and
    their LayerNorms (``4 d``), and the values kept outside the blocks."""
    params = replicated_parameter_count(m) * FLOAT_BYTES * STATE_COPIES
    per_token = m.layers * 4 * m.d + _values_per_token_outside_blocks(m)
    return params + sequences * m.context * per_token * FLOAT_BYTES


@dataclass(frozen=True)
class Split:
    """A split within the budgets: ``parts`` maps what was split (``"sequences"``, ``"heads"``,
    ``"hidden features"``) to its :class:`osmm_jax.Balance`; ``predicted`` is each rank's bytes (the
    estimate above), ``budgets`` each rank's budget, bytes; ``estimate`` says what the estimate
    counts, in words."""

    parts: dict
    predicted: tuple[int, ...]
    budgets: tuple[float, ...]
    estimate: str

    def held(self) -> list[int]:
        """The ranks their memory budget held below their speed share in any part."""
        return sorted({r for result in self.parts.values() for r in result.held_by_memory})

    def lines(self) -> list[str]:
        """The predicted bytes of every rank against its budget, and who memory held back."""
        out = [
            f"  rank {r}: predicted {format_bytes(p)} of its {_budget(b)} budget"
            for r, (p, b) in enumerate(zip(self.predicted, self.budgets))
        ]
        for what, result in self.parts.items():
            for note in result.notes:
                if " held to " in note:  # balance counts rows: say what they are
                    out.append("  " + note.replace(" rows ", f" {what} ", 1))
        held = ", ".join(f"rank {r}" for r in self.held()) or "none"
        out.append(f"held below their speed share by memory: {held}")
        return out


def _budget(b: float) -> str:
    return "unlimited" if math.isinf(b) else format_bytes(b)


def split_dp(m: Model, batch: int, speeds, budgets) -> Split:
    """The batch's sequences per rank by speed within ``budgets`` (bytes per rank), each rank
    costing :func:`dp_fixed_bytes` plus :func:`dp_bytes_per_sequence` per sequence.

    Raises ValueError (the same on every rank) when a rank's budget is below the fixed bytes
    or no split fits, naming the rank."""
    fixed, per_seq = dp_fixed_bytes(m), dp_bytes_per_sequence(m)
    _check_fixed([fixed] * len(budgets), budgets, ["parameters and their state"] * len(budgets))
    try:
        seqs = om.balance(
            batch,
            speeds,
            min_rows=1,
            memory_budget=budgets,
            bytes_per_row=per_seq,
            fixed_bytes=fixed,
        )
    except ValueError as exc:
        raise ValueError(
            f"--budgets: dp: {exc} [a row is one sequence, {format_bytes(per_seq)}; every rank "
            f"also holds {format_bytes(fixed)} of parameters, gradients and adam moments]"
        ) from None
    predicted = tuple(fixed + n * per_seq for n in seqs)
    estimate = (
        f"memory estimate: {format_bytes(fixed)} per rank ({parameter_count(m):,} parameters x 4 "
        f"bytes x 4: values, gradients, adam moments) + {format_bytes(per_seq)} per sequence "
        "(activations kept for the backward pass)"
    )
    return Split({"sequences": seqs}, predicted, tuple(budgets), estimate)


def split_tp(m: Model, batch: int, speeds, budgets, own_sequences=None) -> Split:
    """Heads and MLP hidden features per rank by speed within ``budgets`` (bytes per rank).

    Each rank first holds :func:`tp_fixed_bytes` (``own_sequences[r]`` sequences of residual
    activations in ``sp``; the whole ``batch`` when None, as in ``tp``); the rest of its budget
    is divided between heads and hidden features in proportion to what all of them need
    (``heads x`` :func:`tp_bytes_per_head` against ``4 d x`` :func:`tp_bytes_per_hidden`). The
    heads are split by :func:`osmm_jax.balance` within their part, then the hidden features
    within what the heads left (their part, and what whole heads could not use).

    Raises ValueError (the same on every rank) when a rank's budget is below its fixed bytes
    or no split fits, naming the rank."""
    own = [batch] * len(budgets) if own_sequences is None else list(own_sequences)
    fixed = [tp_fixed_bytes(m, n) for n in own]
    what = [f"the residual activations of {n} sequences" for n in own]
    _check_fixed(fixed, budgets, [f"replicated parameters and their state, and {w}" for w in what])
    per_head, per_hidden = tp_bytes_per_head(m, batch), tp_bytes_per_hidden(m, batch)
    hidden_total = 4 * m.d
    head_fraction = m.heads * per_head / (m.heads * per_head + hidden_total * per_hidden)
    free = [b - f for b, f in zip(budgets, fixed)]  # math.inf stays inf
    share = f"{head_fraction:.0%} of each rank's budget less its replicated bytes"
    heads = _within(m.heads, speeds, [x * head_fraction for x in free], per_head, "head", share)
    left = [x - h * per_head for x, h in zip(free, heads)]
    hidden = _within(
        hidden_total, speeds, left, per_hidden, "hidden feature", "what the heads left"
    )
    parts = {"heads": heads, "hidden features": hidden}
    predicted = tuple(f + h * per_head + u * per_hidden for f, h, u in zip(fixed, heads, hidden))
    estimate = (
        f"memory estimate: {format_bytes(min(fixed))}"
        + ("" if min(fixed) == max(fixed) else f" to {format_bytes(max(fixed))}")
        + f" replicated per rank ({replicated_parameter_count(m):,} parameters x 4 bytes x 4, "
        f"residual activations) + {format_bytes(per_head)} per head + "
        f"{format_bytes(per_hidden)} per MLP hidden feature; the heads get {head_fraction:.0%} "
        "of each budget less its replicated bytes, the hidden features what they leave"
    )
    return Split(parts, predicted, tuple(budgets), estimate)


def _check_fixed(fixed, budgets, what) -> None:
    """ValueError naming the first rank whose budget (bytes) is below its ``fixed`` bytes, held
    whatever its share (``what``, in words): no split lets that rank take part."""
    for r, (f, b) in enumerate(zip(fixed, budgets)):
        if f >= b:
            raise ValueError(
                f"--budgets: rank {r} has {format_bytes(b)} but needs {format_bytes(f)} whatever "
                f"its share ({what[r]}; parameters count 4 bytes x 4 copies: values, gradients, "
                "adam moments)"
            )


def _within(total: int, speeds, budgets, per_row: int, one: str, part: str):
    """``osmm_jax.balance`` of ``total`` heads or hidden features within ``budgets`` (bytes per
    rank, ``part`` of each rank's budget), ``per_row`` bytes each; ValueError naming the rank
    and what a row is when they do not fit."""
    try:
        return om.balance(total, speeds, min_rows=1, memory_budget=budgets, bytes_per_row=per_row)
    except ValueError as exc:
        raise ValueError(
            f"--budgets: {one}s: {exc} [a row is one {one}, {format_bytes(per_row)}; they get "
            f"{part}]"
        ) from None


def split(mode: str, m: Model, batch: int, speeds, budgets, nranks: int, own_sequences=None):
    """:func:`split_dp` (``mode`` ``"dp"``) or :func:`split_tp` (``"tp"``, ``"sp"`` with
    ``own_sequences``: the sequences per rank between the layer pairs) within ``budgets``:
    bytes, one for every rank or one per rank (``nranks``)."""
    budgets = tuple(budgets) * (nranks if len(budgets) == 1 else 1)
    if mode == "dp":
        return split_dp(m, batch, speeds, budgets)
    return split_tp(m, batch, speeds, budgets, own_sequences)


def peaks_line(peaks, reference_on_0: bool) -> str:
    """Every rank's peak resident memory, from ``(peak before the model, peak at the end)`` per
    rank in KiB (``ru_maxrss`` on Linux)."""
    return (
        "peak resident memory per rank (ru_maxrss; before the model in brackets): "
        + ", ".join(
            f"rank {r} {p / 1024:.0f} MiB ({b / 1024:.0f})" for r, (b, p) in enumerate(peaks)
        )
        + ("; rank 0's includes the single-process reference of --check" if reference_on_0 else "")
    )
