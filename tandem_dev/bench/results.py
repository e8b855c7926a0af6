"""Save one ``tandem bench`` run: every table as JSON, every table with a ``Plot`` as PNG, and the context needed to
compare two runs (git commit, machine: cores and load average at start, peers' versions, arguments).

Layout: ``<folder>/results.json`` and ``<folder>/<section>-<n>.png``. The default folder is
``build/bench/<UTC timestamp>/`` (``build/`` is not tracked).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tandem_dev.bench import Plot, Table
from tandem_dev.records import context


def table_doc(table: Table) -> dict[str, Any]:
    return {
        "title": table.title,
        "columns": list(table.columns),
        "rows": [list(row) for row in table.rows],
        "notes": list(table.notes),
    }


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def write_plot(table: Table, plot: Plot, path: Path) -> bool:
    """Draw ``table`` as ``plot`` into ``path`` (PNG); False when no row has numbers to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_at = list(table.columns).index(plot.x)
    series = {y: list(table.columns).index(y) for y in plot.ys}
    rows = [r for r in table.rows if all(_number(r[i]) is not None for i in series.values())]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    labels = [str(r[x_at]) for r in rows]
    width = 0.8 / len(series)
    for n, (name, i) in enumerate(series.items()):
        values = [_number(r[i]) or 0.0 for r in rows]
        if plot.kind == "bar":
            ax.bar([k + n * width for k in range(len(rows))], values, width, label=name)
        else:
            ax.plot([_number(r[x_at]) or 0.0 for r in rows], values, marker="o", label=name)
    if plot.kind == "bar":
        ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(len(rows))], labels, rotation=15, ha="right")
    else:
        ax.set_xlabel(plot.x)
    if plot.log_y:
        ax.set_yscale("log")
    ax.set_ylabel(plot.ylabel)
    ax.set_title(table.title[:110], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


@dataclass
class Results:
    folder: Path
    doc: dict[str, Any]
    sections: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, folder: Path | None, argv: Sequence[str]) -> Results:
        doc = context(argv)
        folder = folder or Path("build") / "bench" / re.sub(r"[-:]", "", doc["started_utc"])
        folder.mkdir(parents=True, exist_ok=True)
        return cls(folder, doc)

    def add(self, section: str, tables: Sequence[Table], seconds: float) -> None:
        docs = []
        for n, table in enumerate(tables):
            doc = table_doc(table)
            png = self.folder / f"{section}-{n}.png"
            if table.figure is not None:
                table.figure(png)
                doc["plot"] = png.name
            elif table.plot is not None and write_plot(table, table.plot, png):
                doc["plot"] = png.name
            docs.append(doc)
        self.sections[section] = {"seconds": round(seconds, 1), "tables": docs}

    def failed(self, section: str, error: str) -> None:
        self.sections[section] = {"failed": error}

    def save(self) -> Path:
        path = self.folder / "results.json"
        path.write_bytes(orjson.dumps({**self.doc, "sections": self.sections}, option=orjson.OPT_INDENT_2))
        return path
