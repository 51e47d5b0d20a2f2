"""Turn the benchmark records into ``results.md`` and PNG plots.

    .venv/bin/python -m benchmarks.report [--raw benchmarks/results/raw.json] [--out benchmarks/results]

Reads the JSON list that ``compare_methods --json`` and ``train_step --json`` append to,
writes ``results.md`` (every case's table and notes, the performance targets with the
measured ratios, and ``analysis.md`` from the same folder if present, which explains the
numbers) and three plots: ``time.png`` (median time per method, one panel per case),
``bytes.png`` (bytes sent per rank: one_sided measured against a ring all-reduce of C) and
``small.png`` (time per call against size). Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def seconds(record: dict, name: str) -> float | None:
    return next((e["seconds"] for e in record["entries"] if e["name"] == name), None)


def by_label(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["label"], []).append(r)
    return out


def ratio(record, slower: str, faster: str) -> float | None:
    s, f = seconds(record, slower), seconds(record, faster)
    return None if s is None or f is None else s / f


def targets(groups: dict[str, list[dict]]) -> list[tuple[str, str, str, bool | None]]:
    """(target, what was measured, required, met?) for every target that has a record."""
    rows = []

    def add(label, text, value, required, ok):
        rows.append((f"({label}) {text}", value, required, ok))

    def faster(label, text, x, required):
        """A target of one_sided at least ``required`` times faster; ``x``: measured."""
        add(label, text, f"{x:.2f}x faster", f">= {required}x", x >= required)

    def within(label, text, x, limit):
        """A target of a time ratio at most ``limit``; ``x``: measured."""
        add(label, text, f"{x:.2f}", f"<= {limit:.2f}", x <= limit)

    if "k_split" in groups:
        r = groups["k_split"][-1]
        faster("i", "one_sided vs allreduce", ratio(r, "allreduce", "one_sided"), 1.25)
        x = ratio(r, "jax_named_sharding", "one_sided")
        if x is not None:
            faster("i", "one_sided vs JAX NamedSharding", x, 1.15)
        x = ratio(r, "one_sided", "floor (local GEMMs only)")
        within("i", "one_sided / no-communication floor", x, 1.10)
    if "ffn" in groups:
        x = ratio(groups["ffn"][-1], "one_sided", "floor (local GEMMs only)")
        within("ii", "one_sided / no-communication floor", x, 1.10)
    if "hetero" in groups:
        r = groups["hetero"][-1]
        x = ratio(r, "allreduce (uniform)", "one_sided")
        faster("iii", "speed-weighted one_sided vs uniform allreduce", x, 1.3)
        x = seconds(r, "one_sided") / r["ideal_limit_s"]
        within("iii", "speed-weighted one_sided / aggregate limit", x, 1.15)
    small = [r for r in groups.get("small", []) if r["dims"][0] == 64]
    if small:
        r = small[-1]
        o, a = seconds(r, "one_sided"), seconds(r, "allreduce")
        add(
            "iv",
            "per-call time at 64^3, one_sided vs allreduce",
            f"{o * 1e6:.0f} vs {a * 1e6:.0f} us",
            "one_sided <= allreduce",
            o <= a,
        )
    if "train_step" in groups:
        x = ratio(groups["train_step"][-1], "allreduce (DDP: uniform)", "one_sided")
        faster("v", "train step, one_sided vs DDP-like allreduce", x, 1.2)
    return rows


def table(record: dict) -> list[str]:
    base = seconds(record, "one_sided")
    lines = [
        f"**{record['title']}**, median of {record['repeats']} after warm-up, interleaved; "
        f"{record['date']}, {record['machine']}",
        "",
        "| method | time (ms) | GFLOP/s | time ÷ one_sided |",
        "| --- | ---: | ---: | ---: |",
    ]
    for e in record["entries"]:
        lines.append(
            f"| {e['name']} | {e['seconds'] * 1e3:.2f} | {e['gflops']:.1f} | {e['seconds'] / base:.2f} |"
        )
    lines.append("")
    lines += [f"- {note}" for note in record.get("notes", [])]
    lines.append("")
    return lines


def write_markdown(records: list[dict], out: Path) -> None:
    groups = by_label(records)
    dates = sorted({r["date"] for r in records})
    lines = [
        "# osmm_jax benchmark results",
        "",
        f"Measured {', '.join(dates)} on {records[0]['machine']} (a shared 2-core machine: "
        "ranks are oversubscribed, so absolute rates are low and noisy; compare ratios within "
        "one table). Regenerate with `make bench`. Plots: [time](time.png), [bytes](bytes.png), "
        "[small sizes](small.png).",
        "",
        "## Targets",
        "",
        "| target | measured | required | met |",
        "| --- | --- | --- | --- |",
    ]
    for text, value, required, ok in targets(groups):
        lines.append(f"| {text} | {value} | {required} | {'yes' if ok else '**no**'} |")
    lines.append("")
    analysis = out / "analysis.md"
    if analysis.exists():
        lines += [analysis.read_text().rstrip(), ""]
    lines += ["## Cases", ""]
    for label, group in groups.items():
        lines += [f"### {label}", ""]
        for record in group:
            lines += table(record)
    (out / "results.md").write_text("\n".join(lines))


def plot(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    big = [r for r in records if r["label"] != "small"]
    fig, axes = plt.subplots(len(big), 1, figsize=(8, 2.2 * len(big) + 0.5), squeeze=False)
    for ax, r in zip(axes[:, 0], big):
        names = [e["name"] for e in r["entries"]]
        values = [e["seconds"] * 1e3 for e in r["entries"]]
        colors = ["tab:blue" if n.startswith("one_sided") else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(r["title"], fontsize=8)
        ax.set_xlabel("median time (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "time.png", dpi=90)
    plt.close(fig)

    sends = [r for r in big if "bytes_measured" in r]
    fig, ax = plt.subplots(figsize=(8, 3))
    width = 0.35
    for i, r in enumerate(sends):
        measured = max(r["bytes_measured"]) / 2**20
        model = r["bytes_allreduce_model"] / 2**20
        ax.bar(
            i - width / 2,
            measured,
            width,
            color="tab:blue",
            label="one_sided (measured, busiest rank)" if i == 0 else None,
        )
        ax.bar(
            i + width / 2,
            model,
            width,
            color="tab:gray",
            label="ring all-reduce of C (model)" if i == 0 else None,
        )
    ax.set_xticks(range(len(sends)), [r["label"] for r in sends])
    ax.set_ylabel("MiB sent per rank per product")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bytes.png", dpi=90)
    plt.close(fig)

    small = sorted((r for r in records if r["label"] == "small"), key=lambda r: r["dims"][0])
    if small:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in [e["name"] for e in small[0]["entries"]]:
            xs = [r["dims"][0] for r in small]
            ys = [seconds(r, name) * 1e6 for r in small]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M = K = N")
        ax.set_ylabel("median time per call (us)")
        ax.set_title(
            small[0]["title"].split(":")[0] + f": K-split on {small[0]['ranks']} ranks", fontsize=9
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "small.png", dpi=90)
        plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="benchmark records -> results.md and plots")
    parser.add_argument("--raw", default=str(RESULTS / "raw.json"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    records = json.loads(Path(args.raw).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_markdown(records, out)
    plot(records, out)
    print(f"wrote {out / 'results.md'} and plots")


if __name__ == "__main__":
    main()
