"""SGLang 0.5.23's JSON contract gate for ``/generate`` bodies, for the fields the simulator reads. Pure.

SGLang checks every ``/generate`` body against its generated schema decoder before serving it
(``generate_contract_error`` in ``sglang/srt/entrypoints/api_contract.py``, decoders in
``sglang/api/v1/api_types.py``) and answers a violation with 400 ``{"error": "<serde's text>"}``:
``GenerateRequest`` ignores unknown keys, ``SamplingParams`` (and ``WatermarkRequestConfig``) reject them, and
every known key must have its declared JSON type. This module reproduces that for the top-level fields in
``GENERATE_TYPES`` and the whole ``SamplingParams``; tests/conformance/test_sglang_requests.py feeds the same
bodies to SGLang's own decoder and compares the messages. Not modelled: FastAPI's dataclass parse that runs
before the gate (it rejects a few values the gate would also reject, with pydantic's text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem_sim.api.sglang_fields import SAMPLING_FIELDS


class ContractError(ValueError):
    """The body violates SGLang's JSON contract; ``str()`` is SGLang's message."""


def _unexpected(v: Any) -> str:
    """serde's ``Unexpected`` display (``api_types._unexpected``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _check(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _int(v: Any, expected: str = "i64") -> None:
    _check(isinstance(v, int) and not isinstance(v, bool), v, expected)


def _float(v: Any, expected: str = "f64") -> None:
    _check(isinstance(v, int | float) and not isinstance(v, bool), v, expected)


def _bool(v: Any, expected: str = "a boolean") -> None:
    _check(isinstance(v, bool), v, expected)


def _str(v: Any, expected: str = "a string") -> None:
    _check(isinstance(v, str), v, expected)


def _seq(v: Any, each: Callable[[Any], None]) -> None:
    _check(isinstance(v, list), v, "a sequence")
    for item in v:
        each(item)


def _or_list(scalar: Callable[[Any, str], None], each: Callable[[Any], None], name: str) -> Callable[[Any], None]:
    """``XOrList``: a list is decoded item by item, anything else as the scalar (with the union's text)."""

    def check(v: Any) -> None:
        if isinstance(v, list):
            _seq(v, each)
        else:
            scalar(v, f"a value or an array of values for {name}")

    return check


def _optional(check: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda v: None if v is None else check(v)


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise ContractError(
            f"invalid type: {_unexpected(v)}, expected a value or an array of values for TokenIdsOrList"
        )
    if not v or (isinstance(v[0], int | float) and not isinstance(v[0], bool)):
        _seq(v, _int)
    else:
        _seq(v, lambda ids: _seq(ids, _int))


def _struct(v: Any, name: str, fields: dict[str, Callable[[Any], None]], order: tuple[str, ...]) -> None:
    """A struct that rejects unknown keys: serde's ``unknown_field`` text lists the known ones in order."""
    _check(isinstance(v, dict), v, f"struct {name}")
    for key, value in v.items():
        if key not in fields:
            raise ContractError(f"unknown field `{key}`, expected one of {', '.join(f'`{f}`' for f in order)}")
        if value is not None:
            fields[key](value)


_STRING_OR_LIST = _or_list(_str, _str, "StringOrList")
_WATERMARK: dict[str, Callable[[Any], None]] = {"enabled": _bool, "key": _str, "context_window": _int}


def _float_map(v: Any) -> None:
    _check(isinstance(v, dict), v, "a map")
    for value in v.values():
        _float(value)


_INTS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width")
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_SAMPLING_TYPES: dict[str, Callable[[Any], None]] = {
    **dict.fromkeys(_INTS, _int),
    **dict.fromkeys(_FLOATS, _float),
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), _str),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"), _bool),
    "stop": _STRING_OR_LIST,
    "stop_regex": _STRING_OR_LIST,
    "stop_token_ids": lambda v: _seq(v, _int),
    "logit_bias": _float_map,
    "custom_params": lambda v: None,
    "watermark": lambda v: _struct(v, "WatermarkRequestConfig", _WATERMARK, tuple(_WATERMARK)),
    "choice": lambda v: _seq(v, _str),
}


def _sampling_params(v: Any) -> None:
    _struct(v, "SamplingParams", _SAMPLING_TYPES, SAMPLING_FIELDS)


def _sampling_params_or_list(v: Any) -> None:
    if isinstance(v, list):
        _seq(v, _sampling_params)
    else:
        _check(isinstance(v, dict), v, "a value or an array of values for SamplingParamsOrList")
        _sampling_params(v)


# The top-level ``GenerateRequest`` fields checked here (``decode_GenerateRequest``); null means "not given".
GENERATE_TYPES: dict[str, Callable[[Any], None]] = {
    "rid": _STRING_OR_LIST,
    "text": _STRING_OR_LIST,
    "input_ids": _token_ids_or_list,
    "stream": _bool,
    "sampling_params": _sampling_params_or_list,
    "return_logprob": _or_list(_bool, _bool, "BoolOrList"),
    "logprob_start_len": _or_list(_int, _int, "Int64OrList"),
    "top_logprobs_num": _or_list(_int, _int, "Int64OrList"),
    "return_text_in_logprobs": _bool,
    "bootstrap_host": _or_list(_str, _optional(_str), "OptionalStringOrList"),
    "bootstrap_port": _or_list(_int, _optional(_int), "OptionalInt64OrList"),
    "bootstrap_room": _or_list(_int, _optional(_int), "OptionalInt64OrList"),
    "routed_dp_rank": _int,
    "priority": _int,
    "routing_key": _str,
    "session_id": _str,
}


def check_generate(body: Any) -> None:
    """Raise ``ContractError`` with SGLang's text when ``body`` violates the contract (first violation wins)."""
    _check(isinstance(body, dict), body, "struct GenerateRequest")
    for key, value in body.items():
        if key in GENERATE_TYPES and value is not None:
            GENERATE_TYPES[key](value)
