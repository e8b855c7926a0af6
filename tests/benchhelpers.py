"""Run one ``tandem bench`` section in quick mode, as the benchmarks' smoke tests do."""

from __future__ import annotations

import subprocess
import sys


def run_quick_bench(section: str, timeout: float) -> str:
    """The section's stdout; fails the test with the tail of stderr if the benchmark exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", section, "--quick"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
