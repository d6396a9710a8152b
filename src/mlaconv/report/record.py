"""The JSON base of the typed reports: a dataclass whose fields are its keys, in order."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints


def optional(when: str | None = None) -> Any:
    """A key written only when its value (or, with ``when``, that other field) is not None."""
    return field(default=None, metadata={"when": when})


@dataclass
class Record:
    """A JSON object with a fixed set of keys: the dataclass fields, renamed by ``metadata["key"]`` where a key is
    no identifier, left out as ``optional`` says."""

    def to_json(self) -> dict:
        out: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if "when" in f.metadata and getattr(self, f.metadata["when"] or f.name) is None:
                continue
            out[f.metadata.get("key", f.name)] = _to_json(value)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Any:
        """The record a ``to_json`` object describes (keys it does not know are left out)."""
        hints, values = get_type_hints(cls), {}
        for f in fields(cls):
            key = f.metadata.get("key", f.name)
            if key in data:
                values[f.name] = _from_json(hints[f.name], data[key])
        return cls(**values)

    @classmethod
    def required_keys(cls) -> set[str]:
        return {f.metadata.get("key", f.name) for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING}


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(hint: Any, value: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if value is None:
        return None
    if origin in (Union, UnionType):  # the record of the union that the keys fit, with the most required keys
        fitting = [a for a in args if isinstance(a, type) and issubclass(a, Record) and isinstance(value, dict)
                   and a.required_keys() <= value.keys()]
        return max(fitting, key=lambda a: len(a.required_keys())).from_json(value) if fitting else value
    if origin is list:
        return [_from_json(args[0], v) for v in value]
    if origin is dict:
        return {k: _from_json(args[1], v) for k, v in value.items()}
    return hint.from_json(value) if isinstance(hint, type) and issubclass(hint, Record) else value


@dataclass
class Failure(Record):
    """A check of the finished checkpoint that failed (the output is kept)."""

    error: str


@dataclass
class WindowSets(Record):
    """Disjoint calibration window indices: fit (statistics, refinement steps), select (choices), audit (figures)."""

    fit: list[int]
    select: list[int]
    audit: list[int]
    note: str | None
