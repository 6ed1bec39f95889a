"""Markdown and JSON output for the experiments."""

from __future__ import annotations

import json
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
