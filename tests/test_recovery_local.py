"""A decode restarted under load at its old Mooncake session id is served again within seconds (issue #18), with
the settings every Tandem worker gets by default (``RECOVERY_ENV``: the operator's PDCluster defaults, the local
stack's worker env). The scenario and its measurement are in tests/plumbing/recovery_local.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.registry import Role
from tandem_dev.local_stack import RECOVERY_ENV
from tandem_operator.api.pdcluster import TransferSpec
from tandem_operator.desired.pods import RoleContext, group_pod
from tests.operator.conftest import kimi_spec
from tests.operator.workers import CLUSTER, POOL
from tests.plumbing.recovery_local import restart_decode_under_load


def test_local_workers_get_the_operators_recovery_defaults() -> None:
    defaults = TransferSpec.model_validate({"protocol": "tcp"})
    assert {
        "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS": str(defaults.metadata_refresh_seconds),
        "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": str(defaults.failed_session_probe_seconds),
        "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": str(defaults.failed_session_probe_max_seconds),
    } == RECOVERY_ENV
    pod = group_pod(RoleContext.build(CLUSTER, kimi_spec(), Role.PREFILL, POOL), 0, 0)
    env = {v["name"]: v.get("value") for v in pod["spec"]["containers"][0]["env"]}
    assert RECOVERY_ENV.items() <= env.items()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_decode_back_under_its_old_session_id_is_served_again_within_seconds(tmp_path: Path) -> None:
    result = await restart_decode_under_load(tmp_path, RECOVERY_ENV, cap_s=60.0)
    print(result)
    assert result.recovered_s is not None, f"not served again within 60 s: {result}"
    assert result.recovered_s < 45.0, result  # bounded, not timed: 0.5-14 s in docs/benchmarks/history/operator.md
    assert result.served_after > 10 * result.failed_after, result  # and it keeps serving
