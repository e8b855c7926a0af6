"""Pure parts of the Kubernetes adapters: SSA/create requests and Event bodies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from tandem_operator.act.k8s.apply import apply_request, collection_path, create_request, object_path
from tandem_operator.act.k8s.events import Regarding, event_manifest
from tandem_operator.decide.reasons import EventType, Reason

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kimi-decode-0-1", "namespace": "llm"}}
POOL = {"apiVersion": "tandem.dev/v1alpha1", "kind": "PDPool", "metadata": {"name": "kimi-decode", "namespace": "llm"}}


def test_paths() -> None:
    assert object_path(POD) == "/api/v1/namespaces/llm/pods/kimi-decode-0-1"
    assert object_path(POOL, "status") == "/apis/tandem.dev/v1alpha1/namespaces/llm/pdpools/kimi-decode/status"
    assert collection_path("events.k8s.io/v1", "Event", "llm") == "/apis/events.k8s.io/v1/namespaces/llm/events"
    with pytest.raises(ValueError, match="no REST path known for apps/v1 Deployment"):
        collection_path("apps/v1", "Deployment", "llm")


def test_server_side_apply_request() -> None:
    request = apply_request(POD)
    assert (request.method, request.path) == ("PATCH", "/api/v1/namespaces/llm/pods/kimi-decode-0-1")
    assert request.query == (("fieldManager", "tandem-operator"), ("force", "true"))
    assert request.headers == {"Content-Type": "application/apply-patch+yaml"}
    assert request.body is POD


def test_create_request_with_its_own_field_manager() -> None:
    request = create_request(POOL, field_manager="tandem-operator-initial-size")
    assert (request.method, request.path) == ("POST", "/apis/tandem.dev/v1alpha1/namespaces/llm/pdpools")
    assert request.query == (("fieldManager", "tandem-operator-initial-size"),)


REGARDING = Regarding("v1", "Pod", "kimi-decode-0-1", "llm", "uid-1")


def test_event_manifest() -> None:
    now = datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    event = event_manifest(
        REGARDING,
        reason=Reason.FENCED,
        note="endpoint removed from the registry",
        action="Fence",
        now=now,
        instance="tandem-operator-0",
        type_=EventType.WARNING,
    )
    assert event == {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"kimi-decode-0-1.{int(now.timestamp() * 1e9):x}", "namespace": "llm"},
        "eventTime": "2026-11-01T10:00:00.123456Z",
        "reportingController": "tandem.dev/operator",
        "reportingInstance": "tandem-operator-0",
        "action": "Fence",
        "reason": "Fenced",
        "type": "Warning",
        "note": "endpoint removed from the registry",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "name": "kimi-decode-0-1", "namespace": "llm", "uid": "uid-1"},
    }


def test_event_note_is_truncated_and_time_must_be_aware() -> None:
    now = datetime(2026, 11, 1, tzinfo=UTC)
    event = event_manifest(
        REGARDING, reason=Reason.GROUP_READY, note="x" * 5000, action="Reconcile", now=now, instance="i"
    )
    assert len(event["note"]) == 1024
    assert event["note"].endswith("...")
    with pytest.raises(ValueError, match="timezone-aware"):
        event_manifest(
            REGARDING, reason=Reason.GROUP_READY, note="", action="a", now=datetime(2026, 1, 1), instance="i"
        )
