"""pydantic validation errors in the words of the Kubernetes API server (what ``kubectl apply`` prints), so a
spec checked offline (``tandem render``) fails with the field paths and messages a real cluster would give.

CEL rules (``api.rules.Rule``) report ``<path><fieldPath>: Invalid value: "object": <message>``, as the API server
does for an ``x-kubernetes-validations`` rule on an object; OpenAPI checks (required, enum, bounds, pattern,
unknown fields) use the API server's phrasing for those.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from tandem_operator.api.rules import CrdModel, Rule


def _all_rules() -> dict[str, Rule]:
    found: dict[str, Rule] = {}
    stack: list[type[CrdModel]] = [CrdModel]
    while stack:
        model = stack.pop()
        stack.extend(model.__subclasses__())
        for rule in model.cel_rules:
            found.setdefault(rule.message, rule)
    return found


def _path(root: str, loc: tuple[int | str, ...]) -> str:
    path = root
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def api_messages(err: ValidationError, root: str = "spec") -> list[str]:
    """One API-server-style message per failure of a model validated from its wire (camelCase) form."""
    rules = _all_rules()
    messages: list[str] = []
    for error in err.errors():
        loc, kind, ctx = tuple(error["loc"]), error["type"], error.get("ctx") or {}
        path = _path(root, loc)
        if kind == "value_error" and str(error["msg"]).startswith("Value error, "):
            text = str(error["msg"]).removeprefix("Value error, ")
            # CrdModel joins the failed rules' messages with "; " (a message may contain "; " itself).
            failed = sorted(((text.find(m), rule) for m, rule in rules.items() if m in text), key=lambda f: f[0])
            for _, rule in failed or [(0, Rule("", text, lambda _: False))]:
                messages.append(f'{path}{rule.field_path or ""}: Invalid value: "object": {rule.message}')
            continue
        messages.append(f"{path}: {_describe(kind, path, error.get('input'), ctx, str(error['msg']))}")
    return messages


def _describe(kind: str, path: str, value: Any, ctx: dict[str, Any], msg: str) -> str:
    if kind == "missing":
        return "Required value"
    if kind == "extra_forbidden":
        return "field not declared in schema"
    if kind in ("literal_error", "enum"):
        allowed = ", ".join(_quoted(ctx.get("expected", "")))
        return f"Unsupported value: {_value(value)}: supported values: {allowed}"
    bounds = {
        "greater_than_equal": ("greater than or equal to", "ge"),
        "less_than_equal": ("less than or equal to", "le"),
        "greater_than": ("greater than", "gt"),
        "less_than": ("less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return f"Invalid value: {_value(value)}: {path} in body should be {words} {ctx.get(key)}"
    if kind in ("too_short", "too_long"):
        words = "at least" if kind == "too_short" else "at most"
        limit = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"Invalid value: {_value(value)}: {path} in body should have {words} {limit} items"
    if kind == "string_pattern_mismatch":
        return f"Invalid value: {_value(value)}: {path} in body should match '{ctx.get('pattern')}'"
    return f"Invalid value: {_value(value)}: {msg}"


def _quoted(expected: str) -> Iterator[str]:
    """pydantic's "'a', 'b' or 'c'" as the API server's '"a", "b", "c"'."""
    for part in expected.replace(" or ", ", ").split(", "):
        if part:
            yield '"' + part.strip("'") + '"'
