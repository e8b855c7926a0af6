"""The autoscaling timeline as a PNG: offered load, groups per role, TTFT and ITL p90 against their targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load started
    load: float  # offered load (concurrent streams, or requests per second)
    prefill: int  # PDPool replicas
    decode: int
    ttft_p90_ms: float | None  # what the autoscaler saw over its last interval
    itl_p90_ms: float | None
    ttft_exact_ms: float | None = None  # the same interval's exact p90, where known (the bench's model)
    itl_exact_ms: float | None = None


def plot_timeline(
    samples: Sequence[Sample],
    ttft_target_ms: float,
    itl_target_ms: float,
    path: Path,
    load_label: str = "concurrent streams",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, (load, groups, ttft, itl) = plt.subplots(4, 1, figsize=(10, 9), dpi=100, sharex=True)
    load.step(t, [s.load for s in samples], where="post", label=load_label)
    load.set_ylabel("load")
    groups.step(t, [s.prefill for s in samples], where="post", label="prefill groups")
    groups.step(t, [s.decode for s in samples], where="post", label="decode groups")
    groups.set_ylabel("groups")
    for ax, values, exact, target, name in (
        (ttft, [s.ttft_p90_ms for s in samples], [s.ttft_exact_ms for s in samples], ttft_target_ms, "TTFT p90"),
        (itl, [s.itl_p90_ms for s in samples], [s.itl_exact_ms for s in samples], itl_target_ms, "ITL p90"),
    ):
        known = any(v is not None for v in exact)
        read = f"{name} read from the router's buckets" if known else name
        ax.plot(t, [float("nan") if v is None else v for v in values], label=read)
        if known:
            ax.plot(t, [float("nan") if v is None else v for v in exact], linewidth=0.8, label=f"{name}, exact")
        ax.axhline(target, color="red", linestyle="--", linewidth=0.8, label=f"target {target:g} ms")
        ax.set_ylabel("ms")
    for ax in (load, groups, ttft, itl):
        ax.legend(fontsize=8, loc="upper right")
    itl.set_xlabel("seconds since the load started")
    load.set_title("SLO-driven autoscaling: load step, then load drop", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
