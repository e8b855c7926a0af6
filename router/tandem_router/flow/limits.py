"""The per-tenant limits file (YAML or JSON), validated by pydantic: a malformed file is refused with a message
naming the field, so the router keeps the last good one.

Tenants are named by the identity the router gives them (``tandem_router.tenants``): ``key:<16 hex digits>`` (the
start of the SHA-256 of an API key, when the router checks keys), ``header:<value>`` (``--client-id-header``) or
``peer:<address>``. A tenant's entry only lists what differs from ``default``.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class LimitsError(ValueError):
    """A limits file that cannot be used; the message names the file and the field."""


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(default=1.0, gt=0, le=1e6, description="Share of the cluster against other busy tenants.")
    priority: int = Field(default=0, ge=-1000, le=1000, description="Priority class of its requests (higher first).")
    min_priority: int | None = Field(default=None, ge=-1000, le=1000, description="Lowest a request may ask.")
    max_priority: int | None = Field(default=None, ge=-1000, le=1000, description="Highest a request may ask.")
    max_concurrency: int | None = Field(default=None, ge=1, description="Requests in flight or queued at once.")
    tokens_per_second: float | None = Field(
        default=None, gt=0, description="Estimated tokens (prompt characters / 4 + output limit) per second."
    )
    requests_per_minute: float | None = Field(default=None, gt=0)
    max_queued: int = Field(default=4096, ge=0, description="Requests waiting in the router's queue at once.")
    queue_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="Longest wait in the router's queue.")

    @model_validator(mode="after")
    def _range(self) -> TenantLimits:
        if self.lowest > self.priority or self.highest < self.priority:
            raise ValueError("min_priority <= priority <= max_priority must hold")
        return self

    @property
    def lowest(self) -> int:
        return self.priority if self.min_priority is None else self.min_priority

    @property
    def highest(self) -> int:
        return self.priority if self.max_priority is None else self.max_priority

    def effective_priority(self, asked: int | None) -> int:
        """The request's own ``priority`` within this tenant's allowance; none asked: the tenant's class."""
        return self.priority if asked is None else min(max(asked, self.lowest), self.highest)


class FlowLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default: TenantLimits = TenantLimits()
    tenants: dict[str, dict[str, object]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tenants(self) -> FlowLimits:
        # Each entry is checked merged over ``default``, so an error names ``tenants.<name>.<field>``.
        base = self.default.model_dump(exclude_unset=True)
        for name, entry in self.tenants.items():
            try:
                TenantLimits.model_validate({**base, **entry})
            except pydantic.ValidationError as err:
                first = err.errors(include_url=False)[0]
                where = ".".join(str(p) for p in ("tenants", name, *first["loc"]))
                raise ValueError(f"{where}: {first['msg']}") from None
        return self

    def resolved(self) -> dict[str, TenantLimits]:
        base = self.default.model_dump(exclude_unset=True)
        return {name: TenantLimits.model_validate({**base, **entry}) for name, entry in self.tenants.items()}


def parse_limits(text: str, source: str) -> FlowLimits:
    """The limits in ``text`` (YAML, so JSON too). Raises ``LimitsError`` naming ``source`` and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise LimitsError(f"{source}: not YAML/JSON: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LimitsError(f"{source}: expected a mapping with 'default' and 'tenants'")
    try:
        return FlowLimits.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise LimitsError(f"{source}: {where + ': ' if where else ''}{message}") from None


def load_limits(path: Path) -> FlowLimits:
    try:
        text = path.read_text()
    except OSError as err:
        raise LimitsError(f"{path}: cannot read: {err.strerror or err}") from None
    return parse_limits(text, str(path))
