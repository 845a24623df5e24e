"""Typed JSON documents: a dataclass whose annotations say what a document holds, read from JSON
that is hostile until checked (the node protocol's replies, a restore journal on disk).

``Document.from_json`` checks every field against its annotation - ``str``, ``int`` (never a
bool), ``float`` (an int is taken), ``bool``, ``Optional[X]``, ``Tuple[X, ...]``, ``List[X]``,
``Dict[str, X]``, another ``Document`` - and raises ``ProtocolError`` naming the document and the
field, never a KeyError or TypeError inside a caller. The value itself is never echoed (it came
from the other end). Rules:

- a field without a default, or named in ``REQUIRED``, must be present (null only if Optional);
- a field with a default may be absent or null: it takes its default;
- a number is finite and an integer fits in 64 bits (signed or not), whatever the parser let
  through; a field named in ``RANGES`` must lie within its (low, high), both included;
- keys the class does not name are ignored: both ends speak one protocol version, and an optional
  field added later stays readable by the end that does not know it.

``to_json`` writes every field, but leaves out an optional one that is None (absent and null read
the same).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar, Dict, Tuple, Type, TypeVar, Union

from etcd_agent.errors import ProtocolError

# A decoded JSON object not yet checked: only where a document is parsed or written, nowhere else.
JsonObject = Dict[str, Any]

D = TypeVar("D", bound="Document")
_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _kind(v: object) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


class Document:
    """Base of the typed documents; subclasses are (frozen) dataclasses."""

    REQUIRED: ClassVar[Tuple[str, ...]] = ()  # present on the wire although they have a default
    RANGES: ClassVar[Dict[str, Tuple[float, float]]] = {}  # numeric fields' (low, high), both included

    def to_json(self) -> JsonObject:
        out: JsonObject = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and _has_default(f):
                continue
            out[f.name] = _dump(v)
        return out

    @classmethod
    def variant(cls: Type[D], d: JsonObject) -> Type[D]:
        """The subclass that reads ``d`` (the base class picks by a tag field); itself by default."""
        return cls

    @classmethod
    def from_json(cls: Type[D], d: object, where: str) -> D:
        """``d`` checked field by field; ProtocolError naming ``where`` and the field if it is not one."""
        if not isinstance(d, dict):
            raise ProtocolError(f"{where}: {cls.__name__} must be a JSON object, not {_kind(d)}")
        kind = cls.variant(d)
        if kind is not cls:
            return kind.from_json(d, where)
        hints = _hints(cls)
        kw: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            v = d.get(f.name)
            if v is None:
                if f.name in cls.REQUIRED or not _has_default(f):
                    if f.name not in d:
                        raise ProtocolError(f"{where}: {cls.__name__} lacks its field {f.name!r}")
                    if f.name in cls.REQUIRED or not _optional(hints[f.name]):
                        raise ProtocolError(f"{where}: {cls.__name__}.{f.name} must not be null")
                    kw[f.name] = None
                continue
            kw[f.name] = _load(hints[f.name], v, f"{cls.__name__}.{f.name}", where)
            bounds = cls.RANGES.get(f.name)
            if bounds is not None and not bounds[0] <= kw[f.name] <= bounds[1]:
                raise ProtocolError(f"{where}: {cls.__name__}.{f.name} must be between {_num(bounds[0])} and {_num(bounds[1])}")
        return cls(**kw)


def _num(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:g}"


def _has_default(f: "dataclasses.Field[Any]") -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) is Union and type(None) in typing.get_args(tp)


def _dump(v: Any) -> Any:
    if isinstance(v, Document):
        return v.to_json()
    if isinstance(v, (tuple, list)):
        return [_dump(x) for x in v]
    if isinstance(v, dict):
        return {k: _dump(x) for k, x in v.items()}
    return v


def _load(tp: Any, v: Any, path: str, where: str) -> Any:
    """``v`` as type ``tp``, or ProtocolError naming ``path``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{path}: only Optional[X] unions are supported")
        return _load(inner[0], v, path, where)
    if tp is Any:
        return v  # a sub-document read by its own checked parser (an error document)
    if isinstance(tp, type) and issubclass(tp, Document):
        return tp.from_json(v, f"{where}: {path}")
    if origin in (tuple, list, dict):
        return _load_container(origin, args, v, path, where)
    return _load_scalar(tp, v, path, where)


def _load_container(origin: Any, args: Tuple[Any, ...], v: Any, path: str, where: str) -> Any:
    if origin is dict:
        if not isinstance(v, dict):
            raise ProtocolError(f"{where}: {path} must be an object, not {_kind(v)}")
        return {str(k): _load(args[1], x, f"{path}[{str(k)[:40]!r}]", where) for k, x in v.items()}
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: {path} must be a list, not {_kind(v)}")
    items = [_load(args[0], x, f"{path}[{i}]", where) for i, x in enumerate(v)]
    return tuple(items) if origin is tuple else items


def _load_scalar(tp: Any, v: Any, path: str, where: str) -> Any:
    ok = {str: lambda: isinstance(v, str), bool: lambda: isinstance(v, bool),
          int: lambda: isinstance(v, int) and not isinstance(v, bool),
          float: lambda: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(tp)
    if ok is None:
        raise TypeError(f"{path}: no JSON reading of {tp!r}")
    if not ok():
        raise ProtocolError(f"{where}: {path} must be {_WHAT[tp]}, not {_kind(v)}")
    if tp in (int, float) and not (isinstance(v, int) and -(1 << 63) <= v < 1 << 64
                                   or isinstance(v, float) and math.isfinite(v)):
        raise ProtocolError(f"{where}: {path} is out of range (a 64-bit integer or a finite number)")
    return float(v) if tp is float else v


_WHAT = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}

__all__ = ["Document", "JsonObject", "ProtocolError"]
