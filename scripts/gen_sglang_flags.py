#!/usr/bin/env python3
"""Regenerate tandem/data/sglang_flags_<version>.json from the pinned SGLang wheel, without importing sglang.

SGLang 0.5.23 declares most ``launch_server`` flags as annotated fields (``name: A[T, Arg(...)] = default``) of
the namespace classes in ``sglang/srt/arg_groups/fields/*.py`` and registers the rest by hand in
``ServerArgs.add_cli_args`` (``sglang/srt/server_args.py``). This script reads both with ``ast`` and writes one
entry per flag: names, dest, kind, value type, nargs, choices, default.

Usage: scripts/gen_sglang_flags.py [--output PATH] [--check]
``--check`` exits 1 when the committed file differs from the regenerated one (used by ``make verify``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

from tandem_dev import peers

VERSION = peers.SGLANG_VERSION
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "tandem" / "data" / f"sglang_flags_{VERSION}.json"
FIELDS_PREFIX = "sglang/srt/arg_groups/fields/"
# Type parsers whose input we can validate without sglang; anything else is taken as a string.
TYPE_PARSERS = {"json.loads": "json", "json_list_type": "json_list", "human_readable_int": "human_int"}
SCALARS = {"str": "str", "int": "int", "float": "float", "bool": "bool"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ast.unparse(node)


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return None
    if isinstance(node, ast.Call) and _dotted(node.func).endswith("field"):
        for kw in node.keywords:
            if kw.arg == "default_factory":
                return {"list": [], "dict": {}, "set": []}.get(_dotted(kw.value))
            if kw.arg == "default":
                return _literal(kw.value)
        return None
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    if isinstance(value, set | frozenset | tuple):
        return sorted(value, key=str) if isinstance(value, set | frozenset) else list(value)
    return value


class Sources:
    """Module-level constants of the files that define choices, read with ast."""

    def __init__(self, wheel: zipfile.ZipFile) -> None:
        self.constants: dict[str, Any] = {}
        for name in (
            "sglang/srt/arg_groups/choices.py",
            "sglang/srt/parser/reasoning_parser_names.py",
            "sglang/srt/function_call/parser_names.py",
        ):
            for stmt in ast.parse(wheel.read(name)).body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    value = _literal(stmt.value)
                    if value is None:
                        value = self.choices(stmt.value)
                    if value is not None:
                        self.constants[stmt.targets[0].id] = value
        consts = ast.parse(wheel.read("sglang/kernels/ops/kv_canary/consts.py"))
        for cls in consts.body:
            if isinstance(cls, ast.ClassDef) and cls.name == "RealKvHashMode":
                members = [s.targets[0] for s in cls.body if isinstance(s, ast.Assign)]
                self.constants["_real_kv_hash_modes"] = [t.id.lower() for t in members if isinstance(t, ast.Name)]
        self.constants["_reasoning_parser_choices"] = self.constants["REASONING_PARSER_NAMES"]
        self.constants["_tool_call_parser_choices"] = self.constants["TOOL_CALL_PARSER_NAMES"]

    def choices(self, node: ast.expr | None) -> list[Any] | None:
        if node is None:
            return None
        if isinstance(node, ast.Name):
            value = self.constants.get(node.id)
            return sorted(value, key=str) if isinstance(value, list) and node.id.endswith("_SET") else value
        if isinstance(node, ast.Call) and _dotted(node.func) in {"set", "frozenset", "list"} and node.args:
            return self.choices(node.args[0])
        if isinstance(node, ast.Call) and not node.args and _dotted(node.func) in self.constants:
            return list(self.constants[_dotted(node.func)])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.choices(node.left), self.choices(node.right)
            return None if left is None or right is None else list(left) + list(right)
        if isinstance(node, ast.ListComp):
            # [m.name.lower() for m in _real_kv_hash_modes()]
            gen = node.generators[0].iter
            if isinstance(gen, ast.Call):
                return self.constants.get(_dotted(gen.func))
        value = _literal(node)
        return value if isinstance(value, list) else None


def _unwrap_type(node: ast.expr) -> tuple[str, str | None, list[Any] | None]:
    """(value type, container, literal choices) of a field annotation's first element."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        side = node.left if not (isinstance(node.left, ast.Constant) and node.left.value is None) else node.right
        return _unwrap_type(side)
    if isinstance(node, ast.Subscript):
        head = _dotted(node.value).split(".")[-1]
        inner = node.slice
        if head == "Optional":
            return _unwrap_type(inner)
        if head == "Union" and isinstance(inner, ast.Tuple):
            rest = [e for e in inner.elts if not (isinstance(e, ast.Constant) and e.value is None)]
            return _unwrap_type(rest[0]) if len(rest) == 1 else ("str", None, None)
        if head in {"List", "list"}:
            return _unwrap_type(inner)[0], "list", None
        if head == "Literal":
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            values = [_literal(e) for e in elts]
            kind = type(values[0]).__name__ if values else "str"
            return SCALARS.get(kind, "str"), None, values
        return "str", None, None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _unwrap_type(ast.parse(node.value, mode="eval").body)
    return SCALARS.get(_dotted(node), "str"), None, None


def field_entry(stmt: ast.AnnAssign, sources: Sources) -> dict[str, Any] | None:
    """The flag a ``name: A[T, meta] = default`` field declares (mirrors add_cli_args_from_dataclass)."""
    if not isinstance(stmt.target, ast.Name) or not isinstance(stmt.annotation, ast.Subscript):
        return None
    if _dotted(stmt.annotation.value) not in {"A", "Annotated"} or not isinstance(stmt.annotation.slice, ast.Tuple):
        return None
    type_node, *meta_nodes = stmt.annotation.slice.elts
    meta: dict[str, ast.expr] = {}
    for node in meta_nodes:
        if isinstance(node, ast.Call) and _dotted(node.func) == "Arg":
            meta = {kw.arg: kw.value for kw in node.keywords if kw.arg}
            break
        if isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp):
            break
    else:
        return None
    if _literal(meta.get("no_cli")) is True:
        return None
    dest = stmt.target.id
    cli_name = _literal(meta.get("cli_name")) or "--" + dest.replace("_", "-")
    names = [cli_name, *(_literal(meta.get("aliases")) or [])]
    vtype, container, literal_choices = _unwrap_type(type_node)
    entry: dict[str, Any] = {"names": names, "dest": dest, "default": _literal(stmt.value)}
    action = meta.get("action")
    parser = meta.get("type_parser")
    parser_kind = TYPE_PARSERS.get(_dotted(parser), "str") if parser is not None else None
    if action is not None:
        action_name = _dotted(action)
        if action_name.endswith("BooleanOptionalAction"):
            entry.update(kind="boolean_optional")
        else:
            kwargs = meta.get("action_kwargs")
            nargs = None
            if isinstance(kwargs, ast.Dict):
                for key, value in zip(kwargs.keys, kwargs.values, strict=True):
                    if key is not None and _literal(key) == "nargs":
                        nargs = _literal(value)
            entry.update(kind="value", type="str", nargs=nargs)
    elif literal_choices is not None:
        choices = sources.choices(meta.get("choices")) or literal_choices
        entry.update(kind="value", type=parser_kind or vtype, choices=choices)
    elif container == "list" and parser is None:
        entry.update(kind="value", type=vtype, nargs=_literal(meta.get("nargs")) or "+")
        entry["choices"] = sources.choices(meta.get("choices"))
    elif vtype == "bool" and parser is None:
        entry.update(kind="store_true")
    else:
        entry.update(kind="value", type=parser_kind or vtype, nargs=_literal(meta.get("nargs")))
        entry["choices"] = sources.choices(meta.get("choices"))
        required = _literal(meta.get("required"))
        entry["required"] = required is True or (required is None and stmt.value is None)
    return entry


def manual_entries(tree: ast.Module, defaults: dict[str, Any], sources: Sources) -> list[dict[str, Any]]:
    """The ``parser.add_argument`` calls of ``ServerArgs.add_cli_args``."""
    out: list[dict[str, Any]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name == "add_cli_args"):
            continue
        assigned: dict[str, ast.expr] = {}
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                assigned[stmt.targets[0].id] = stmt.value
            if not (isinstance(stmt, ast.Call) and _dotted(stmt.func) == "parser.add_argument"):
                continue
            names = [a.value for a in stmt.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            kw = {k.arg: k.value for k in stmt.keywords if k.arg}
            dest = _literal(kw.get("dest")) or names[0].lstrip("-").replace("-", "_")
            default_node = kw.get("default")
            if isinstance(default_node, ast.Call) and _dotted(default_node.func) == "_declared_default":
                default = defaults.get(str(_literal(default_node.args[0])))
            else:
                default = _literal(default_node)
            entry: dict[str, Any] = {"names": names, "dest": dest, "default": default}
            action = kw.get("action")
            action_name = _dotted(action) if action is not None else None
            if (
                action_name == "'store_true'"
                or (action_name or "").startswith("DeprecatedStoreTrue")
                or (action_name is not None and _literal(kw.get("nargs")) is None and "nargs" not in kw)
            ):
                entry.update(kind="store_true")
            else:
                choices_node = kw.get("choices")
                if isinstance(choices_node, ast.Name) and choices_node.id in assigned:
                    choices_node = assigned[choices_node.id]
                if isinstance(choices_node, ast.BinOp) and isinstance(choices_node.right, ast.Name):
                    right = assigned.get(choices_node.right.id)
                    if right is not None:
                        choices_node = ast.BinOp(choices_node.left, ast.Add(), right)
                choices = sources.choices(choices_node)
                entry.update(kind="value", type=SCALARS.get(_dotted(kw["type"]), "str") if "type" in kw else "str")
                entry.update(nargs=_literal(kw.get("nargs")), choices=choices)
            out.append(entry)
    return out


def generate(wheel_path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel_path) as wheel:
        sources = Sources(wheel)
        flags: list[dict[str, Any]] = []
        for name in sorted(n for n in wheel.namelist() if n.startswith(FIELDS_PREFIX) and n.endswith(".py")):
            for cls in ast.parse(wheel.read(name)).body:
                if not isinstance(cls, ast.ClassDef):
                    continue
                has_ns = any(
                    isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NS_PATH" for t in s.targets)
                    for s in cls.body
                )
                if has_ns:
                    flags += [e for s in cls.body if isinstance(s, ast.AnnAssign) and (e := field_entry(s, sources))]
        defaults = {f["dest"]: f["default"] for f in flags}
        flags += manual_entries(ast.parse(wheel.read("sglang/srt/server_args.py")), defaults, sources)
    for flag in flags:
        for key in ("type", "nargs", "choices"):
            flag.setdefault(key, None)
        flag.setdefault("required", False)
    flags.sort(key=lambda f: str(f["names"][0]))
    return {"sglang_version": VERSION, "source": f"sglang-{VERSION} wheel (PyPI), read with ast", "flags": flags}


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--check", action="store_true", help="fail if the committed file is out of date")
    args = parser.parse_args()
    try:
        wheel = peers.require("sglang-wheel")  # the pinned, hash-checked wheel that `make peers` fetches
    except peers.PeerMissingError:
        peers.PEERS["sglang-wheel"].install()  # `make generate` runs outside the network namespace
        wheel = peers.require("sglang-wheel")
    text = render(generate(wheel))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(
                f"gen_sglang_flags: {args.output.name} is out of date; run scripts/gen_sglang_flags.py", file=sys.stderr
            )
            return 1
        print(f"gen_sglang_flags: {args.output.name} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"gen_sglang_flags: wrote {len(json.loads(text)['flags'])} flags to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
