"""Validation rules written once, enforced twice: by the API server (CEL) and by pydantic (Python).

A ``Rule`` pairs a CEL expression with a Python predicate and one message. ``CrdModel`` subclasses list their
rules in ``cel_rules``; the CRD generator copies them into ``x-kubernetes-validations`` of the model's schema, and
the model validator runs the Python predicate, so an invalid spec fails with the same message whether it is
rejected by ``kubectl apply`` or by the operator reading an object that was stored before a rule existed.

Transition rules (``self == oldSelf``) need the previous object, which only the API server has; they are declared
per field with ``immutable()`` and have no Python side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


@dataclass(frozen=True)
class Rule:
    """One cross-field rule: ``cel`` runs in the API server with ``self`` bound to the model's object."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None

    def to_schema(self) -> dict[str, str]:
        rule = {"rule": self.cel, "message": self.message}
        if self.field_path is not None:
            rule["fieldPath"] = self.field_path
        return rule


def immutable(message: str) -> dict[str, Any]:
    """``json_schema_extra`` for a field the API server must keep unchanged after creation."""
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message}]}


class CrdModel(BaseModel):
    """Base of every custom-resource model: camelCase on the wire, unknown fields rejected, rules enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, use_enum_values=False
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> CrdModel:
        failed = [rule.message for rule in self.cel_rules if not rule.check(self)]
        if failed:
            raise ValueError("; ".join(failed))
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        if cls.cel_rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [rule.to_schema() for rule in cls.cel_rules]
        return schema

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, enums as strings, unset optionals omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
