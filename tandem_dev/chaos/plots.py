"""The chaos run's PNG plots: streams ended per second (OK and not) with the faults marked, and each fault's time
to fence and to recover."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tandem_dev.chaos.report import ChaosReport, timeline


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(report: ChaosReport, path: Path) -> None:
    plt = _pyplot()
    points = timeline(report)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    ax.plot([t for t, _, _ in points], [ok for _, ok, _ in points], label="streams completed OK / s")
    ax.plot([t for t, _, _ in points], [bad for _, _, bad in points], color="red", label="streams not OK / s")
    top = ax.get_ylim()[1]
    for n, fault in enumerate(report.faults):  # labels at staggered heights: faults can be a second apart
        ax.axvline(fault.at, color="grey", linestyle="--", linewidth=0.8)
        ax.text(fault.at, top * (0.97 - 0.1 * (n % 4)), f" {fault.kind}\n {fault.victim}", fontsize=7, va="top")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("streams ended per second")
    ax.set_title(f"chaos ({report.setting}): throughput and errors, faults marked", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_recovery(report: ChaosReport, path: Path) -> None:
    plt = _pyplot()
    labels = [f"{f.kind}\n{f.victim}" for f in report.faults]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    xs = range(len(report.faults))
    ax.bar([x - 0.2 for x in xs], [f.fenced or 0.0 for f in report.faults], 0.4, label="time to fence (0: n/a)")
    ax.bar([x + 0.2 for x in xs], [f.recovered or 0.0 for f in report.faults], 0.4, label="time to recover")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("seconds from injection")
    ax.set_title(f"chaos ({report.setting}): time to fence and to recover, per fault", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
