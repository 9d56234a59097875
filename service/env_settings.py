"""How ``ROUTEREPLAY_*`` environment strings become setting values.

pydantic-settings reads a list or dict setting from the environment as JSON only, and a value that
is not JSON stops the service with ``error parsing value for field ... from source
"EnvSettingsSource"``. People type lists as ``a,b``: a list setting here takes either form, and a
value neither form reads is an error naming the variable and the forms it takes.
"""

from __future__ import annotations

import json
import types
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

__all__ = ["DICT_FORM", "LIST_FORM", "EnvValueError", "SettingsEnvSource", "container_of"]

LIST_FORM = 'a comma-separated list (a,b) or a JSON list (["a","b"])'
DICT_FORM = "a JSON object ('{\"key\": value}')"


class EnvValueError(ValueError):
    """A ``ROUTEREPLAY_*`` value that no accepted form reads; the message names both."""

    def __init__(self, variable: str, problem: str, form: str) -> None:
        super().__init__(f"{variable}: {problem}; expected {form}")
        self.variable = variable


def container_of(field: FieldInfo) -> type | None:
    """``list`` or ``dict`` for a list- or dict-valued field (``X | None`` included), else None."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    origin = get_origin(annotation) or annotation
    if origin in (list, tuple, set, frozenset):
        return list
    if origin is dict:
        return dict
    return None


def _load_json(variable: str, text: str, form: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        problem = f"not valid JSON ({e.msg} at column {e.colno})"
        raise EnvValueError(variable, problem, form) from None


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return f"a JSON {kinds.get(type(value), 'number')}"


def _decode_list(variable: str, raw: str) -> list[Any]:
    text = raw.strip()
    if not text.startswith(("[", "{")):
        # Surrounding spaces and empty items (a trailing comma) are typing noise, not values.
        return [item.strip() for item in text.split(",") if item.strip()]
    value = _load_json(variable, text, LIST_FORM)
    if not isinstance(value, list):
        raise EnvValueError(variable, f"{_json_kind(value)}, not a list", LIST_FORM)
    return value


def _decode_dict(variable: str, raw: str) -> dict[str, Any]:
    if not raw.strip():
        return {}
    value = _load_json(variable, raw, DICT_FORM)
    if not isinstance(value, dict):
        raise EnvValueError(variable, f"{_json_kind(value)}, not an object", DICT_FORM)
    return value


class SettingsEnvSource(EnvSettingsSource):
    """The environment source of :class:`~.settings.Settings`: lists comma-separated or JSON,
    dicts JSON, and a bad value an error naming its variable."""

    def variable(self, field_name: str) -> str:
        return f"{self.env_prefix}{field_name}".upper()

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        kind = container_of(field)
        if not isinstance(value, str) or kind is None:
            return super().decode_complex_value(field_name, field, value)
        if kind is list:
            return _decode_list(self.variable(field_name), value)
        return _decode_dict(self.variable(field_name), value)

    def __call__(self) -> dict[str, Any]:
        try:
            return super().__call__()
        except SettingsError as e:
            # pydantic-settings wraps the decode error in one that names only the field.
            if isinstance(e.__cause__, EnvValueError):
                raise SettingsError(str(e.__cause__)) from None
            raise
