"""``tandem bench images --quick`` runs end to end from the built image and prints its facts and start-up times."""

from __future__ import annotations

import re

import pytest

from tandem_dev.images.run import Unpacked
from tests.plumbing.imagehelpers import tandem_image
from tests.tandem_dev.benchhelpers import run_quick_bench

__all__ = ["tandem_image"]


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_bench_images_quick_prints_the_images_facts(tandem_image: Unpacked) -> None:
    out = run_quick_bench("images", timeout=290)
    assert tandem_image.digest[:19] in out
    for row in ("archive (MiB)", "layers", "uncompressed (MiB)", "tandem router", "tandem operator --help"):
        line = next(line for line in out.splitlines() if row in line)
        numbers = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,.]+) ", line + " ")]
        assert numbers, line
        assert all(x > 0 for x in numbers), line
