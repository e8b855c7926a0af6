"""What the kubelet would write in a simulated pod's status (pure: times passed in).

The pod runner owns, for the container it runs, what a kubelet owns: the container's state (running, or
terminated with its exit code) and ``restartCount``, its ``ready`` flag (its readinessProbe, or started when it has
none), the pod's ``Ready`` and ``ContainersReady`` conditions, and the terminal phase. As the kubelet
(``pkg/kubelet/kuberuntime``, ``status/generate.go``): with ``restartPolicy: Never`` an exited container ends the
pod (``Succeeded`` if it exited 0, else ``Failed``); ``OnFailure`` restarts it after a non-zero exit, ``Always``
after any exit, each restart after the kubelet's crash-loop back-off (none for the first, then 10 s doubling to
300 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    started_at: str
    finished_at: str

    @property
    def reason(self) -> str:
        return "Completed" if self.exit_code == 0 else "Error"

    def to_wire(self) -> dict[str, Any]:
        return {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }


@dataclass(frozen=True)
class ContainerView:
    """One run of the container: ``terminated`` is None while it runs."""

    name: str
    image: str
    started_at: str
    restart_count: int = 0
    ready: bool = False
    terminated: Terminated | None = None
    last_terminated: Terminated | None = None
    waiting_reason: str | None = None  # "CrashLoopBackOff" between an exit and its restart


def restarts(restart_policy: str, exit_code: int) -> bool:
    """Whether the kubelet starts the container again after it exited with ``exit_code``."""
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def backoff_s(restart_count: int) -> float:
    """Delay before restart number ``restart_count + 1`` (the first restart is immediate)."""
    if restart_count == 0:
        return 0.0
    return float(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** (restart_count - 1)))


def _container_status(view: ContainerView, uid: str) -> dict[str, Any]:
    if view.terminated is not None:
        state: dict[str, Any] = {"terminated": view.terminated.to_wire()}
    elif view.waiting_reason is not None:
        state = {"waiting": {"reason": view.waiting_reason}}
    else:
        state = {"running": {"startedAt": view.started_at}}
    status: dict[str, Any] = {
        "name": view.name,
        "image": view.image,
        "imageID": "",
        "containerID": f"tandem-sim://{uid}-{view.restart_count}",
        "ready": view.ready and "running" in state,
        "started": "running" in state,
        "restartCount": view.restart_count,
        "state": state,
    }
    if view.last_terminated is not None:
        status["lastState"] = {"terminated": view.last_terminated.to_wire()}
    return status


def _condition(previous: Mapping[str, Any] | None, kind: str, ok: bool, now: str, reason: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    unchanged = previous is not None and previous.get("status") == status
    condition = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": previous.get("lastTransitionTime", now) if unchanged and previous else now,
    }
    if not ok:
        condition["reason"] = reason
    return condition


def status_patch(pod: Mapping[str, Any], view: ContainerView, restart_policy: str, now: str) -> dict[str, Any]:
    """A merge patch of ``pod``'s status: this container's status, Ready/ContainersReady, and the phase.

    Other containers' statuses are kept; the pod is Ready only when every container is. The patch carries the
    pod's ``metadata.uid``, as the kubelet's does (``statusutil.PatchPodStatus``): the API server then refuses it
    (422, "metadata.uid: field is immutable") when the pod was deleted and another one of the same name created, so
    a dead pod's last report can never mark its successor Failed.
    """
    status = pod.get("status") or {}
    uid = pod["metadata"]["uid"]
    others = [c for c in status.get("containerStatuses") or () if c.get("name") != view.name]
    ours = _container_status(view, uid)
    containers = sorted([*others, ours], key=lambda c: str(c["name"]))
    all_ready = all(c.get("ready") for c in containers)
    phase = status.get("phase", "Running")
    if view.terminated is not None and not restarts(restart_policy, view.terminated.exit_code):
        phase = "Succeeded" if view.terminated.exit_code == 0 else "Failed"
    reason = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
    by_type = {c.get("type"): c for c in status.get("conditions") or ()}
    updated = {
        "Ready": _condition(by_type.get("Ready"), "Ready", all_ready, now, reason),
        "ContainersReady": _condition(by_type.get("ContainersReady"), "ContainersReady", all_ready, now, reason),
    }
    conditions = [updated.pop(str(c.get("type")), c) for c in status.get("conditions") or ()]
    conditions.extend(updated.values())
    return {
        "metadata": {"uid": uid},
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": containers},
    }
