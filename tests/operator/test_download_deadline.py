"""The start deadline excludes the weight download (issue #35): ``lifecycle.startDeadlineSeconds`` counts from when
a member's prefetch init container finished, the download itself is bounded by ``weightDownloadDeadlineSeconds``.
Pure: ``observe.prefetch`` and ``recovery.stuck_groups`` on pods as the API server returns them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView, PrefetchState, prefetch, slim_pod
from tandem_operator.decide.recovery import Stuck, stuck_groups
from tests.operator.conftest import kimi_spec
from tests.operator.workers import live_pod

SHA = "0123456789abcdef0123456789abcdef01234567"
CACHE = {"hostPath": "/mnt/nvme/models", "repo": "moonshotai/Kimi-K2.6"}
MODEL = {"path": "/models/Kimi-K2.6", "revision": SHA, "weightCache": CACHE}
SPEC = kimi_spec(transfer={"protocol": "tcp"}, model=MODEL)
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
START_S, DOWNLOAD_S = 5400, 21600


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def member(age_s: int, init: dict[str, Any] | None, *, started: bool = False, rank: int = 0) -> dict[str, Any]:
    """A decode member created ``age_s`` ago whose prefetch init container reports ``init`` (None: no status yet)."""
    pod = live_pod(SPEC, Role.DECODE, 0, rank, ready=False)
    pod["metadata"]["creationTimestamp"] = _stamp(NOW - timedelta(seconds=age_s))
    pod["status"]["phase"] = "Running" if started or (init or {}).get("state", {}).get("terminated") else "Pending"
    if init is not None:
        pod["status"]["initContainerStatuses"] = [{"name": "prefetch-weights", "restartCount": 0, **init}]
    pod["status"]["containerStatuses"] = [{"name": "sglang", "started": started, "restartCount": 0, "state": {}}]
    return pod


def downloading() -> dict[str, Any]:
    return {"state": {"running": {"startedAt": _stamp(NOW - timedelta(hours=3))}}}


def finished(ago_s: int, exit_code: int = 0) -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": exit_code, "finishedAt": _stamp(NOW - timedelta(seconds=ago_s))}}}


def stuck(*pods: dict[str, Any], state: GroupState = GroupState.STARTING) -> dict[GroupKey, Stuck]:
    by_name = {p["metadata"]["name"]: p for p in pods}
    views = {0: GroupView(0, state, "h", tuple(by_name))}
    return stuck_groups(Role.DECODE, views, by_name, NOW, deadline_s=START_S, download_deadline_s=DOWNLOAD_S)


def test_a_pod_still_downloading_past_the_start_deadline_is_not_fenced() -> None:
    pod = member(START_S + 3600, downloading())
    assert prefetch(pod).state is PrefetchState.RUNNING
    assert stuck(pod) == {}


def test_a_download_restarted_after_a_failure_still_counts_as_downloading() -> None:
    crashed = {"restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {}}}
    pod = member(START_S + 3600, crashed)
    assert prefetch(pod).state is PrefetchState.RUNNING
    assert stuck(pod) == {}
    assert stuck(member(START_S + 3600, finished(60, exit_code=1))) == {}  # failed, about to be restarted


def test_a_download_past_its_own_deadline_is_fenced_as_such() -> None:
    pod = member(DOWNLOAD_S + 1, downloading())
    assert stuck(pod) == {GroupKey(Role.DECODE, 0): Stuck(pod["metadata"]["name"], downloading=True)}


def test_the_start_deadline_counts_from_the_prefetch_finish() -> None:
    loading = member(DOWNLOAD_S, finished(START_S - 60))  # created 6 h ago, staged 1.5 h ago less a minute
    assert prefetch(loading).state is PrefetchState.DONE
    assert stuck(loading) == {}
    overdue = member(DOWNLOAD_S, finished(START_S + 1))
    assert stuck(overdue) == {GroupKey(Role.DECODE, 0): Stuck(overdue["metadata"]["name"])}


def test_a_started_group_is_never_stuck_and_one_not_yet_prefetching_keeps_the_start_deadline() -> None:
    assert stuck(member(DOWNLOAD_S * 2, finished(DOWNLOAD_S), started=True)) == {}
    pending = member(START_S + 1, None)  # unschedulable: its prefetch never ran
    assert prefetch(pending).state is PrefetchState.WAITING
    assert stuck(pending) == {GroupKey(Role.DECODE, 0): Stuck(pending["metadata"]["name"])}
    waiting = member(START_S + 1, {"state": {"waiting": {"reason": "PodInitializing"}}})  # pulling the image
    assert stuck(waiting) == {GroupKey(Role.DECODE, 0): Stuck(waiting["metadata"]["name"])}


def test_a_member_still_downloading_holds_its_group_and_is_the_one_named() -> None:
    loaded = member(DOWNLOAD_S, finished(START_S + 600), rank=0)
    slow = member(START_S + 600, downloading(), rank=1)
    assert stuck(loaded, slow) == {}
    slow = member(DOWNLOAD_S + 1, downloading(), rank=1)
    assert stuck(loaded, slow) == {GroupKey(Role.DECODE, 0): Stuck(slow["metadata"]["name"], downloading=True)}


def test_without_a_prefetch_the_start_deadline_counts_from_creation() -> None:
    pod = live_pod(kimi_spec(transfer={"protocol": "tcp"}), Role.DECODE, 0, 0, ready=False)
    pod["metadata"]["creationTimestamp"] = _stamp(NOW - timedelta(seconds=START_S + 1))
    assert prefetch(pod).state is PrefetchState.NONE
    assert stuck(pod) == {GroupKey(Role.DECODE, 0): Stuck(pod["metadata"]["name"])}


@pytest.mark.parametrize(
    "init",
    [None, downloading(), finished(60), finished(60, exit_code=1), {"restartCount": 1, "state": {"waiting": {}}}],
)
def test_a_slim_pod_keeps_the_prefetch(init: dict[str, Any] | None) -> None:
    pod = member(600, init)
    pod["status"]["initContainerStatuses"] = [
        {**c, "image": "i", "imageID": "x", "containerID": "y"} for c in pod["status"].get("initContainerStatuses", ())
    ]
    assert prefetch(slim_pod(pod)) == prefetch(pod)


def test_the_download_deadline_is_bounded() -> None:
    with pytest.raises(ValidationError, match=r"weight_download_deadline_seconds|weightDownloadDeadlineSeconds"):
        kimi_spec(lifecycle={"weightDownloadDeadlineSeconds": 60})
    assert kimi_spec().lifecycle.weight_download_deadline_seconds == DOWNLOAD_S
