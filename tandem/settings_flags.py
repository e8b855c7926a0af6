"""Command-line flags made from pydantic settings models, so that a setting is declared once: its type, description
and default make its flag (``--x-y`` for field ``x_y``; repeated for lists, ``--x/--no-x`` for booleans, the
choices of an enum). The router makes every flag of ``RouterSettings`` here; the operator makes the etcd client's
(``tandem.etcd_settings.EtcdClientSettings``, a group), the same flags the router has.

Settings may be grouped: a field whose type is a ``SettingsGroup`` holds a nested model, and its settings keep flat
flags (``--flow-reserve-share`` for ``flow_control.reserve_share``): the group names each setting's flat name, the
flag undashed (``flat_fields``). ``nest`` moves values given by flat name under their group; ``FlatEnvSource``
reads ``<PREFIX><FLAT NAME>`` environment variables for grouped settings as the flags' spelling."""

from __future__ import annotations

import argparse
from collections.abc import Container, Mapping
from enum import StrEnum
from types import UnionType
from typing import Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, SettingsError


def flag_of(name: str, renamed: Mapping[str, str] | None = None) -> str:
    """The flag of field ``name``: ``renamed``'s spelling, else the name dashed."""
    return (renamed or {}).get(name, "--" + name.replace("_", "-"))


def kind_of(annotation: Any) -> Any:
    """``X`` of ``X | None``, else the annotation itself."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if get_origin(annotation) in (UnionType, Union) and len(args) == 1 else annotation


class SettingsGroup(BaseModel):
    """Settings held together as one field of a settings model, flat on the command line: setting ``x`` is flag
    ``--<flag_prefix>x``, or ``flag_names[x]`` (undashed) where that names it. A group with an ``enabled`` setting
    takes a plain value for the whole group as that (``integrity: false`` is ``integrity.enabled: false``)."""

    model_config = ConfigDict(extra="forbid")
    flag_prefix: ClassVar[str] = ""
    flag_names: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def flat_name(cls, name: str) -> str:
        return cls.flag_names.get(name, cls.flag_prefix + name)

    @model_validator(mode="before")
    @classmethod
    def _switch(cls, data: Any) -> Any:
        if "enabled" in cls.model_fields and isinstance(data, str | bool | int):
            return {"enabled": data}
        return data


def group_of(field: FieldInfo) -> type[SettingsGroup] | None:
    kind = kind_of(field.annotation)
    return kind if isinstance(kind, type) and issubclass(kind, SettingsGroup) else None


def flat_fields(fields: Mapping[str, FieldInfo]) -> dict[str, tuple[tuple[str, ...], FieldInfo]]:
    """Every setting of a model's ``fields`` by its flat name (its flag, undashed): its path in the model (the
    field's name, or a group's and the setting's) and its field. Raises ``ValueError`` on a flat name given twice."""
    flat: dict[str, tuple[tuple[str, ...], FieldInfo]] = {}
    for name, field in fields.items():
        group = group_of(field)
        entries: dict[str, tuple[tuple[str, ...], FieldInfo]] = {name: ((name,), field)}
        if group is not None:
            entries = {group.flat_name(k): ((name, k), f) for k, f in group.model_fields.items()}
        for flat_name, entry in entries.items():
            if flat_name in flat:
                raise ValueError(f"settings {flat[flat_name][0]} and {entry[0]} share the flat name {flat_name}")
            flat[flat_name] = entry
    return flat


def nest(values: Mapping[str, Any], fields: Mapping[str, FieldInfo]) -> dict[str, Any]:
    """``values`` with those given by a grouped setting's flat name moved under their group (they win over the
    group's own value of the same setting; a group given a plain value keeps it as its ``enabled``)."""
    paths = {k: path for k, (path, _) in flat_fields(fields).items() if len(path) == 2}
    kept = {k: v for k, v in values.items() if k not in paths or (k in fields and isinstance(v, Mapping | BaseModel))}
    nested = dict(kept)
    for key, value in values.items():
        if key in kept:
            continue
        group, name = paths[key]
        current = nested.get(group, {})
        if isinstance(current, BaseModel):
            current = current.model_dump(exclude_unset=True)
        elif not isinstance(current, Mapping):
            current = {"enabled": current}
        nested[group] = {**current, name: value}
    return nested


class FlatEnvSource(EnvSettingsSource):
    """The environment, where a grouped setting is also read as ``<env_prefix><FLAT NAME>`` (the flag's spelling:
    ``TANDEM_ROUTER_FLOW_RESERVE_SHARE``; it wins over pydantic-settings' nested ``..._FLOW_CONTROL__RESERVE_SHARE``)
    and a group's plain value (``TANDEM_ROUTER_INTEGRITY=off``) is its ``enabled``."""

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool) -> Any:
        group = group_of(field)
        if group and "enabled" in group.model_fields and isinstance(value, str) and value.lstrip()[:1] != "{":
            return {"enabled": value, **self.explode_env_vars(field_name, field, self.env_vars)}
        return super().prepare_field_value(field_name, field, value, value_is_complex)

    def __call__(self) -> dict[str, Any]:
        fields = self.settings_cls.model_fields
        flat = {}
        for flat_name, (path, field) in flat_fields(fields).items():
            value = self.env_vars.get(self._apply_case_sensitive(self.env_prefix + flat_name))
            if len(path) == 2 and flat_name not in fields and value is not None:
                flat[flat_name] = self._flat_value(flat_name, field, value)
        return nest({**super().__call__(), **flat}, fields)

    def _flat_value(self, flat_name: str, field: FieldInfo, value: str) -> Any:
        """A grouped setting's variable read as a top-level setting's is: JSON where the setting is a list or a
        model (``TANDEM_ROUTER_ETCD_ENDPOINTS='["10.0.0.1:2379"]'``), a malformed one a ``SettingsError``."""
        try:
            return super().prepare_field_value(flat_name, field, value, value_is_complex=False)
        except ValueError as err:
            raise SettingsError(
                f'error parsing value for field "{flat_name}" from source "{type(self).__name__}"'
            ) from err


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
    """One flag per setting (but ``skip``), ``dest`` its flat name (``flat_fields``: the field's name, or a grouped
    setting's) and no argparse default: a flag not given is absent from the namespace's non-None values, so the
    model's own default (or a file, or the environment) holds; ``nest`` puts the values given under their groups."""
    for name, (_, field) in flat_fields(fields).items():
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
