"""SGLang ``launch_server`` flags as data: load the table generated from the pinned wheel and build a parser.

The table (``tandem/data/sglang_flags_<version>.json``) is written by ``scripts/gen_sglang_flags.py`` from the
SGLang wheel itself, so the simulator accepts exactly the flags SGLang accepts, and the operator can check the
command lines it generates against the same source (``validate_command``). Values are checked for type and
choices; SGLang's cross-flag validation (resolution hooks) is not reproduced.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

SGLANG_VERSION = "0.5.23"
# The HTTP server's accept queue: ``http_server.py``: ``launch_server`` builds ``uvicorn.Config`` without a backlog,
# so uvicorn's default holds (the simulator and the bench's instant workers listen with the same).
SGLANG_HTTP_BACKLOG = 2048
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@dataclass(frozen=True)
class FlagSpec:
    """One SGLang flag: every spelling, where it stores, and what value it takes."""

    names: tuple[str, ...]
    dest: str
    kind: str  # "value" | "store_true" | "boolean_optional"
    type: str | None  # "str" | "int" | "float" | "json" | "json_list" | "human_int"
    nargs: str | None
    choices: tuple[Any, ...] | None
    default: Any
    required: bool


def human_readable_int(value: str) -> int:
    """SGLang's ``human_readable_int``: ``4096``, ``25.6k``, ``1Mi``."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix in _IEC:
        if "." in number:
            raise ValueError(f"decimals are not allowed with IEC suffix {suffix!r}: {value!r}")
        return int(number) * _IEC[suffix]
    return int(float(number) * _SI[suffix])


def _json_value(value: str) -> Any:
    return json.loads(value)


def _json_list(value: str) -> list[Any]:
    parsed = json.loads(value)
    if not isinstance(parsed, list):
        raise ValueError(f"expected a JSON list, got {value!r}")
    return parsed


_TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "json": _json_value,
    "json_list": _json_list,
    "human_int": human_readable_int,
}


@cache
def load_flags(version: str = SGLANG_VERSION) -> tuple[FlagSpec, ...]:
    text = resources.files("tandem").joinpath(f"data/sglang_flags_{version}.json").read_text()
    doc = json.loads(text)
    return tuple(
        FlagSpec(
            names=tuple(f["names"]),
            dest=f["dest"],
            kind=f["kind"],
            type=f["type"],
            nargs=f["nargs"],
            choices=tuple(f["choices"]) if f["choices"] is not None else None,
            default=f["default"],
            required=bool(f["required"]),
        )
        for f in doc["flags"]
    )


def add_sglang_flags(parser: argparse.ArgumentParser, version: str = SGLANG_VERSION) -> None:
    """Register every SGLang flag on ``parser`` with SGLang's dest, type, nargs, choices and default."""
    for flag in load_flags(version):
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default}
        if flag.kind == "store_true":
            kwargs["action"] = "store_true"
        elif flag.kind == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _TYPES.get(flag.type or "str", str)
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
            if flag.choices is not None:
                kwargs["choices"] = list(flag.choices)
            if flag.required:
                kwargs["required"] = True
        parser.add_argument(*flag.names, **kwargs)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit
        raise ValueError(message)


def build_parser(prog: str = "sglang.launch_server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    add_sglang_flags(parser)
    return parser


def validate_command(argv: Sequence[str]) -> list[str]:
    """Errors SGLang's own parser would report for ``argv`` (the args after ``launch_server``); [] if valid."""
    parser = _RaisingParser(prog="sglang.launch_server", allow_abbrev=False, add_help=False)
    add_sglang_flags(parser)
    try:
        parser.parse_args(list(argv))
    except ValueError as err:
        return [str(err)]
    return []
