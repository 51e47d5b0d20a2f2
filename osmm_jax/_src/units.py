"""Human-readable quantities for reports and plots (pure Python)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"1.5 MiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
