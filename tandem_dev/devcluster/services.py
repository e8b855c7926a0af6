"""Service names where the dev cluster has no DNS: the pod a Service selects, and Service hosts in a hook's URLs.
Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

SERVICE_HOST = re.compile(
    r"^(?P<svc>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.svc(\.cluster\.local)?$"
)


def selected_pod_ip(pods: Sequence[Mapping[str, Any]], namespace: str, selector: Mapping[str, str]) -> str | None:
    """The IP of a Running, not deleting pod in ``namespace`` whose labels contain ``selector``."""
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace") != namespace or meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        if selector and all(labels.get(k) == v for k, v in selector.items()) and status.get("podIP"):
            return str(status["podIP"])
    return None


URL_HOST = re.compile(r"(?P<scheme>https?://)(?P<host>[^/:\s]+)")


def url_service_refs(words: Sequence[str]) -> set[tuple[str, str]]:
    """(namespace, service) of every Service DNS name in the URLs of ``words`` (a preStop hook's command)."""
    refs = set()
    for word in words:
        for url in URL_HOST.finditer(word):
            if match := SERVICE_HOST.match(url["host"]):
                refs.add((match["ns"], match["svc"]))
    return refs


def resolve_urls(words: Sequence[str], addresses: Mapping[tuple[str, str], str]) -> list[str]:
    """``words`` with each Service host in a URL replaced by its pod IP (left as it is when unknown: the command
    then fails to resolve it, as it would without the Service)."""

    def host(url: re.Match[str]) -> str:
        match = SERVICE_HOST.match(url["host"])
        ip = addresses.get((match["ns"], match["svc"])) if match else None
        return f"{url['scheme']}{ip or url['host']}"

    return [URL_HOST.sub(host, word) for word in words]
