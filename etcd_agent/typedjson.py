"""Typed JSON documents: a dataclass whose annotations say what a document holds, read from JSON
that is hostile until checked (the node protocol's replies, a restore journal, a segment's header,
a kept replay's result on disk).

``Document.from_json`` checks every field against its annotation - ``str``, ``int`` (never a
bool), ``float`` (an int is taken), ``bool``, ``Optional[X]``, ``Tuple[X, ...]``, ``Tuple[X, Y]``
(exactly that many), ``List[X]``, ``Dict[str, X]``, another ``Document`` - and raises one error
naming the document and the field, never a KeyError or TypeError inside a caller. The value itself
is never echoed (it came from the other end). Rules:

- a field without a default, or named in ``REQUIRED``, must be present (null only if Optional);
- a field with a default may be absent or null: it takes its default;
- a number is finite and an integer fits in 64 bits (signed or not), whatever the parser let
  through; a field named in ``RANGES`` must lie within its (low, high), both included;
- a field annotated ``Annotated[str, Text(...)]`` is bounded in length (and may be held to a
  pattern or a set of words), ``Annotated[Tuple[X, ...], Items(low, high)]`` in its count; a
  field whose JSON form is not its Python one (a hex string for an id, an ISO time) names its
  ``Codec``, and ``Key`` names its JSON key when that is not the field's name;
- keys the class does not name are ignored (both ends speak one protocol version, and an optional
  field added later stays readable by the end that does not know it), unless the class is
  ``CLOSED``; ``TAGS`` are constant keys (a format's name and version) that must hold one of
  their values;
- ``violation()`` states a rule across fields (None when the document keeps it);
- ``ENVELOPE`` names the key of an outer object the record is wrapped in (``{"ready": {...}}``).

Which error a refusal is (ProtocolError, SegmentCorrupt, StreamError ...) is the record's own:
``ERROR``, or ``refused`` when that class is built another way. A document nested in another is
refused as the outer one is: the reader of the outer record says what a damaged one means.

``to_json`` writes every field, but leaves out an optional one that is None (absent and null read
the same) and those named in ``OMIT_DEFAULT`` while they hold their default (older readers see the
record they know).
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple, Type, TypeVar, Union

from etcd_agent.errors import AgentError, ProtocolError

# A decoded JSON object not yet checked: only where a document is parsed or written, nowhere else.
JsonObject = Dict[str, Any]

D = TypeVar("D", bound="Document")
_HINTS: Dict[type, Dict[str, Any]] = {}


@dataclass(frozen=True)
class Text:
    """A string field's bounds: at most ``max_len`` characters, matching ``pattern`` (whole) or
    one of ``choices`` when given."""

    max_len: int
    pattern: str = ""
    choices: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Items:
    """A list's, tuple's or object's count: within ``low`` .. ``high``, both included."""

    low: int
    high: int


@dataclass(frozen=True)
class Codec:
    """A field whose JSON form is not its Python one: ``read`` the JSON value (ValueError with the
    problem when it is not one), ``write`` it back."""

    read: Callable[[Any], Any]
    write: Callable[[Any], Any]


@dataclass(frozen=True)
class Key:
    """The JSON key of a field named otherwise in Python."""

    name: str


def _read_hex(v: Any) -> int:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-fA-F]{0,16}", v):
        raise ValueError("must be up to 16 hex digits")
    return int(v or "0", 16)


HEX = Codec(_read_hex, lambda v: f"{v:x}")  # a 64-bit id as etcd prints it ("" reads as 0)


class _Refused(Exception):
    """A problem found inside a document; ``from_json`` turns it into the record's own error."""


def _hints(cls: type) -> Dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return hints


def _kind(v: object) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _split(tp: Any) -> Tuple[Any, Tuple[Any, ...]]:
    """(the type, its Annotated markers)."""
    if typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        return args[0], tuple(args[1:])
    return tp, ()


def _marker(marks: Tuple[Any, ...], kind: Type[Any]) -> Any:
    return next((m for m in marks if isinstance(m, kind)), None)


class Document:
    """Base of the typed documents; subclasses are (frozen) dataclasses."""

    REQUIRED: ClassVar[Tuple[str, ...]] = ()  # present on the wire although they have a default
    RANGES: ClassVar[Dict[str, Tuple[float, float]]] = {}  # numeric fields' (low, high), both included
    ERROR: ClassVar[Type[AgentError]] = ProtocolError  # what a refusal of this record raises
    ENVELOPE: ClassVar[str] = ""  # the record is {ENVELOPE: {...}} on the wire
    NOT_ENVELOPED: ClassVar[str] = ""  # what a refusal says when the outer object lacks it
    CLOSED: ClassVar[bool] = False  # keys the class does not name are refused
    TAGS: ClassVar[Dict[str, Tuple[object, ...]]] = {}  # constant keys: the values read, the first written
    OMIT_DEFAULT: ClassVar[Tuple[str, ...]] = ()  # fields left out while they hold their default

    def to_json(self) -> JsonObject:
        out: JsonObject = {k: vs[0] for k, vs in self.TAGS.items()}
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and _has_default(f) or f.name in self.OMIT_DEFAULT and v == _default(f):
                continue
            tp, marks = _split(hints[f.name])
            key, codec = _marker(marks, Key), _marker(marks, Codec)
            out[key.name if key else f.name] = codec.write(v) if codec and v is not None else _dump(v)
        return {self.ENVELOPE: out} if self.ENVELOPE else out

    def violation(self) -> Optional[str]:
        """A rule across fields the document breaks (one sentence), or None."""
        return None

    @classmethod
    def refused(cls, where: str, problem: str) -> AgentError:
        """The error a refused record raises: ``ERROR`` of "<where>: <problem>"."""
        return cls.ERROR(f"{where}: {problem}")

    @classmethod
    def variant(cls: Type[D], d: JsonObject) -> Type[D]:
        """The subclass that reads ``d`` (the base class picks by a tag field); itself by default."""
        return cls

    @classmethod
    def from_json(cls: Type[D], d: object, where: str) -> D:
        """``d`` checked field by field; the record's error naming ``where`` and the field if it is not one."""
        try:
            return cls._read(d)
        except _Refused as exc:
            raise cls.refused(where, str(exc)) from None

    @classmethod
    def _read(cls: Type[D], d: object) -> D:
        if cls.ENVELOPE:
            if not isinstance(d, dict) or not isinstance(d.get(cls.ENVELOPE), dict):
                raise _Refused(cls.NOT_ENVELOPED or f"not a {cls.__name__} (no {cls.ENVELOPE!r} object)")
            d = d[cls.ENVELOPE]
        if not isinstance(d, dict):
            raise _Refused(f"{cls.__name__} must be a JSON object, not {_kind(d)}")
        kind = cls.variant(d)
        if kind is not cls:
            return kind._read(d)
        cls._check_keys(d)
        hints = _hints(cls)
        kw: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            tp, marks = _split(hints[f.name])
            key = _marker(marks, Key)
            name = key.name if key else f.name
            v = d.get(name)
            if v is None:
                if f.name in cls.REQUIRED or not _has_default(f):
                    if name not in d:
                        raise _Refused(f"{cls.__name__} lacks its field {name!r}")
                    if f.name in cls.REQUIRED or not _optional(tp):
                        raise _Refused(f"{cls.__name__}.{name} must not be null")
                    kw[f.name] = None
                continue
            kw[f.name] = _field(tp, marks, v, f"{cls.__name__}.{name}")
            bounds = cls.RANGES.get(f.name)
            if bounds is not None and not bounds[0] <= kw[f.name] <= bounds[1]:
                raise _Refused(f"{cls.__name__}.{name} must be between {_num(bounds[0])} and {_num(bounds[1])}")
        doc = cls(**kw)
        problem = doc.violation()
        if problem is not None:
            raise _Refused(problem)
        return doc

    @classmethod
    def _check_keys(cls, d: JsonObject) -> None:
        for k, values in cls.TAGS.items():
            v = d.get(k)
            if not any(type(v) is type(x) and v == x for x in values):
                raise _Refused(f"{cls.__name__}.{k} must be {' or '.join(repr(x) for x in values[:4])}")
        if cls.CLOSED:
            hints = _hints(cls)
            known = set(cls.TAGS)
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                key = _marker(_split(hints[f.name])[1], Key)
                known.add(key.name if key else f.name)
            extra = sorted(str(k)[:40] for k in d if k not in known)
            if extra:
                raise _Refused(f"{cls.__name__} has unknown field(s) {', '.join(extra[:5])}")


def _num(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:g}"


def _has_default(f: "dataclasses.Field[Any]") -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: "dataclasses.Field[Any]") -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


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


def _field(tp: Any, marks: Tuple[Any, ...], v: Any, path: str) -> Any:
    """A field's value (not null) as its annotation and markers say."""
    codec = _marker(marks, Codec)
    if codec is not None:
        try:
            return codec.read(v)
        except ValueError as exc:
            raise _Refused(f"{path} {exc}") from None
    if _optional(tp):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    out = _load(tp, v, path)
    text, items = _marker(marks, Text), _marker(marks, Items)
    if text is not None:
        _text(text, out, path)
    if items is not None and not items.low <= len(out) <= items.high:
        raise _Refused(f"{path} must hold {items.low} to {items.high} items, not {len(out)}")
    return out


def _text(rule: Text, v: str, path: str) -> None:
    if len(v) > rule.max_len:
        raise _Refused(f"{path} is longer than {rule.max_len} characters")
    if rule.choices and v not in rule.choices:
        raise _Refused(f"{path} must be one of {', '.join(rule.choices)}")
    if rule.pattern and not re.fullmatch(rule.pattern, v):
        raise _Refused(f"{path} is malformed")


def _load(tp: Any, v: Any, path: str) -> Any:
    """``v`` as type ``tp``, or _Refused naming ``path``."""
    tp, marks = _split(tp)
    if marks:
        return _field(tp, marks, v, path) if v is not None else _load(tp, v, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{path}: only Optional[X] unions are supported")
        return _load(inner[0], v, path)
    if tp is Any:
        return v  # a sub-document read by its own checked parser (an error document)
    if isinstance(tp, type) and issubclass(tp, Document):
        try:
            return tp._read(v)
        except _Refused as exc:
            raise _Refused(f"{path}: {exc}") from None
    if origin in (tuple, list, dict):
        return _load_container(origin, args, v, path)
    return _load_scalar(tp, v, path)


def _load_container(origin: Any, args: Tuple[Any, ...], v: Any, path: str) -> Any:
    if origin is dict:
        if not isinstance(v, dict):
            raise _Refused(f"{path} must be an object, not {_kind(v)}")
        return {str(k): _load(args[1], x, f"{path}[{str(k)[:40]!r}]") for k, x in v.items()}
    if not isinstance(v, list):
        raise _Refused(f"{path} must be a list, not {_kind(v)}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(v) != len(args):  # a fixed-length tuple: (key id, mac), (revision, time) ...
            raise _Refused(f"{path} must be a list of {len(args)}, not of {len(v)}")
        return tuple(_load(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    items = [_load(args[0], x, f"{path}[{i}]") for i, x in enumerate(v)]
    return tuple(items) if origin is tuple else items


def _load_scalar(tp: Any, v: Any, path: str) -> Any:
    ok = {str: lambda: isinstance(v, str), bool: lambda: isinstance(v, bool),
          int: lambda: isinstance(v, int) and not isinstance(v, bool),
          float: lambda: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(tp)
    if ok is None:
        raise TypeError(f"{path}: no JSON reading of {tp!r}")
    if not ok():
        raise _Refused(f"{path} must be {_WHAT[tp]}, not {_kind(v)}")
    if tp in (int, float) and not (isinstance(v, int) and -(1 << 63) <= v < 1 << 64
                                   or isinstance(v, float) and math.isfinite(v)):
        raise _Refused(f"{path} is out of range (a 64-bit integer or a finite number)")
    return float(v) if tp is float else v


_WHAT = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}

__all__ = ["Codec", "Document", "HEX", "Items", "JsonObject", "Key", "ProtocolError", "Text"]
