"""Markdown and JSON output for the experiments."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Report:
    """One experiment's write-up: a title, paragraphs, tables and the raw numbers."""

    name: str
    title: str
    setup: str
    sections: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)

    def table(
        self, header: Sequence[str], rows: Sequence[Sequence[object]], caption: str = ""
    ) -> None:
        lines = [f"**{caption}**", ""] if caption else []
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
        self.sections.append("\n".join(lines))

    def paragraph(self, heading: str, text: str) -> None:
        self.sections.append(f"### {heading}\n\n{text.strip()}")

    def markdown(self) -> str:
        parts = [f"# {self.title}", self.setup.strip(), *self.sections]
        return "\n\n".join(parts) + "\n"

    def write(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        md = directory / f"{self.name}.md"
        js = directory / f"{self.name}.json"
        md.write_text(self.markdown())
        js.write_text(json.dumps(self.data, indent=2, sort_keys=True, default=str) + "\n")
        return [md, js]


def _cell(value: object) -> str:
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def pct(value: float) -> str:
    """A signed percentage: -0.4 -> '-40.0 %'."""
    return f"{value * 100:+.1f} %"


#: How the reports decide "inside" or "outside" (quoted under each verdict column).
VERDICT_RULE = (
    "Verdicts are computed from the numbers: a paper's range includes its ends; a single "
    "figure's range is every value that rounds to it at the precision the paper prints "
    '(91.6 % is 91.55 % to 91.65 %); "> x" is every value above x and "< x" every value below. '
    '"Below" and "above" compare signed values: a cut of 46 % (−46 %) is below a cut of 40 %.'
)


def figure(value: float, unit: float) -> tuple[float, float]:
    """The range of a single printed figure: ``figure(0.916, 0.001)`` -> (0.9155, 0.9165).

    ``unit`` is the value of the last digit the paper prints (0.01 for "40 %" as a fraction).
    """
    return (value - unit / 2, value + unit / 2)


def above(value: float) -> tuple[float, float]:
    """The range of "more than ``value``" (exclusive)."""
    # Just above ``value``, clear of the rounding slack ``verdict`` allows at a range's ends.
    return (value + 1e-9 * max(1.0, abs(value)), math.inf)


def below(value: float) -> tuple[float, float]:
    """The range of "less than ``value``" (exclusive)."""
    return (-math.inf, value - 1e-9 * max(1.0, abs(value)))


def verdict(ours: float | Sequence[float], paper: tuple[float, float]) -> str:
    """``inside`` or ``outside (below|above)`` the paper's closed range ``paper`` = (low, high).

    For several values (one per scale, rate or workload): ``inside (all N)`` or ``outside (k of
    N: …)``, naming which side the values outside fall on.
    """
    low, high = paper
    # A relative tolerance for binary rounding only (2.2 is not exactly 2.2 in floating point).
    slack = 1e-12 * max(1.0, *(abs(end) for end in paper if math.isfinite(end)))
    values = [ours] if isinstance(ours, (int, float)) else list(ours)
    under = sum(value < low - slack for value in values)
    over = sum(value > high + slack for value in values)
    if not under and not over:
        return "inside" if len(values) == 1 else f"inside (all {len(values)})"
    sides = " and ".join(side for side, count in (("below", under), ("above", over)) if count)
    if len(values) == 1:
        return f"outside ({sides})"
    return f"outside ({under + over} of {len(values)}: {sides})"
