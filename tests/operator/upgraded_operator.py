"""``tandem operator`` as a newer release would run it: the same code, one more env var in every worker pod -- a
change of rendering with no change of the spec, as an operator upgrade brings. For test_upgrade_live.py:
``python -m tests.operator.upgraded_operator <tandem operator arguments>``."""

from __future__ import annotations

import sys
from typing import Any

from tandem.cli import main
from tandem_operator.desired import pods

UPGRADE_ENV = "TANDEM_TEST_UPGRADED"
_rendered_env = pods._env


def _upgraded_env(ctx: pods.RoleContext, epoch: int) -> list[dict[str, Any]]:
    return [*_rendered_env(ctx, epoch), {"name": UPGRADE_ENV, "value": "1"}]


if __name__ == "__main__":
    setattr(pods, "_env", _upgraded_env)  # noqa: B010 (group_pod reads the module global)
    sys.exit(main(["operator", *sys.argv[1:]]))
