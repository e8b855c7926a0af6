"""The ``tandem operator`` process: keeps ``kubernetes_asyncio`` out of it, then runs ``tandem_operator.run.main``.

The operator talks to the API server with the shared client (``tandem.kube``), but kopf imports
``kubernetes_asyncio`` whenever it is installed (the package depends on it for the dev tooling and the tests) only
to recognise that library's model objects, which the operator never hands it; those imports alone were ~40 MiB of
the operator's RSS. Marking the package absent before kopf is first imported makes kopf fall back to its
placeholders (its ``thirdparty`` module catches the ImportError). Done here, in the process's entry, not at import
of ``main``: a test process that imports ``main`` keeps its own ``kubernetes_asyncio``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

KEPT_OUT = "kubernetes_asyncio"


def main(argv: Sequence[str]) -> int:
    if KEPT_OUT not in sys.modules:
        sys.modules[KEPT_OUT] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
    from tandem_operator.run.main import main as run  # kopf is imported from here on

    return run(argv)
