"""Run one ``tandem bench`` section in quick mode, as the benchmarks' smoke tests do."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_quick_bench(section: str, timeout: float) -> str:
    """The section's stdout; fails the test with the tail of stderr if the benchmark exits non-zero or saves no
    results (results go to a temporary folder, not build/bench/)."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-results-") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "bench", section, "--quick", "--results-dir", out],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        saved = json.loads((Path(out) / "results.json").read_text())
        assert saved["sections"][section]["tables"], saved
    return done.stdout
