"""Command-line flags made from pydantic settings models, so that a setting is declared once: its type, description
and default make its flag (``--x-y`` for field ``x_y``; repeated for lists, ``--x/--no-x`` for booleans, the
choices of an enum). The router makes every flag of ``RouterSettings`` here; the operator makes the etcd client's
(``tandem.etcd_settings.EtcdClientSettings``), the same flags the router has."""

from __future__ import annotations

import argparse
from collections.abc import Container, Mapping
from enum import StrEnum
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo


def flag_of(name: str, renamed: Mapping[str, str] | None = None) -> str:
    """The flag of field ``name``: ``renamed``'s spelling, else the name dashed."""
    return (renamed or {}).get(name, "--" + name.replace("_", "-"))


def kind_of(annotation: Any) -> Any:
    """``X`` of ``X | None``, else the annotation itself."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if get_origin(annotation) in (UnionType, Union) and len(args) == 1 else annotation


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None or value == []:
        return ""
    shown = value.value if isinstance(value, StrEnum) else value
    return f" (default: {shown})"


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    fields: Mapping[str, FieldInfo],
    *,
    renamed: Mapping[str, str] | None = None,
    metavars: Mapping[str, str] | None = None,
    skip: Container[str] = (),
) -> None:
    """One flag per field (but ``skip``), ``dest`` the field's name and no argparse default: a flag not given is
    absent from the namespace's non-None values, so the model's own default (or a file, or the environment) holds."""
    for name, field in fields.items():
        if name in skip:
            continue
        kind = kind_of(field.annotation)
        text = ((field.description or "") + _default(field)).replace("%", "%%")
        flag = flag_of(name, renamed)
        if kind is bool:
            parser.add_argument(flag, dest=name, help=text, action=argparse.BooleanOptionalAction)
        elif get_origin(kind) is list:
            metavar = (metavars or {}).get(name, "VALUE")
            parser.add_argument(flag, dest=name, help=text, action="append", metavar=metavar)
        elif isinstance(kind, type) and issubclass(kind, StrEnum):
            parser.add_argument(flag, dest=name, help=text, choices=[x.value for x in kind])
        else:
            parser.add_argument(flag, dest=name, help=text, type=kind if kind in (int, float) else str)
