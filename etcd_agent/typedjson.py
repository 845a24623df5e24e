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


_HEX = re.compile(r"[0-9a-fA-F]{0,16}")


def _read_hex(v: Any) -> int:
    if not isinstance(v, str) or not _HEX.fullmatch(v):
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
        for f, slot in zip(dataclasses.fields(self), _plan(type(self)).slots):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and _has_default(f) or f.name in self.OMIT_DEFAULT and v == _default(f):
                continue
            codec = slot.codec
            out[slot.key] = codec.write(v) if codec is not None and v is not None else _dump(v)
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
        plan = _plan(cls)
        cls._check_keys(d, plan)
        kw: Dict[str, Any] = {}
        for slot in plan.slots:
            v = d.get(slot.key)
            if v is None:
                if slot.must:
                    if slot.key not in d:
                        raise _Refused(f"{cls.__name__} lacks its field {slot.key!r}")
                    if not slot.nullable:
                        raise _Refused(f"{slot.path} must not be null")
                    kw[slot.name] = None
                continue
            try:
                x = kw[slot.name] = slot.read(v)
            except _Bad as exc:
                raise _Refused(f"{slot.path}{exc.rest}") from None
            if slot.bounds is not None and not slot.bounds[0] <= x <= slot.bounds[1]:
                raise _Refused(f"{slot.path} must be between {_num(slot.bounds[0])} and {_num(slot.bounds[1])}")
        doc = cls(**kw)
        problem = doc.violation()
        if problem is not None:
            raise _Refused(problem)
        return doc

    @classmethod
    def _check_keys(cls, d: JsonObject, plan: "_Plan") -> None:
        for k, values in cls.TAGS.items():
            v = d.get(k)
            if not any(type(v) is type(x) and v == x for x in values):
                raise _Refused(f"{cls.__name__}.{k} must be {' or '.join(repr(x) for x in values[:4])}")
        if cls.CLOSED:
            extra = sorted(str(k)[:40] for k in d if k not in plan.keys)
            if extra:
                raise _Refused(f"{cls.__name__} has unknown field(s) {', '.join(extra[:5])}")


@dataclass(frozen=True)
class _Slot:
    """How one field is read: worked out once per class from its annotations."""

    name: str  # the field's
    key: str  # its JSON key
    path: str  # "Class.key", as refusals name it
    read: "Reader"  # the value (not null) as its type (Annotated and Optional taken off) and markers say
    codec: Optional[Codec]  # how it is written, when not as itself
    must: bool  # present on the wire: no default, or named in REQUIRED
    nullable: bool  # present as null: Optional, and not named in REQUIRED
    bounds: Optional[Tuple[float, float]]


@dataclass(frozen=True)
class _Marks:
    codec: Optional[Codec] = None
    text: Optional[Text] = None
    items: Optional[Items] = None


@dataclass(frozen=True)
class _Plan:
    slots: Tuple[_Slot, ...]
    keys: "frozenset[str]"  # every key the class names (its fields' and its tags)


_PLANS: Dict[type, _Plan] = {}


def _marks(meta: Tuple[Any, ...]) -> _Marks:
    return _Marks(_marker(meta, Codec), _marker(meta, Text), _marker(meta, Items))


def _plan(cls: Type[Document]) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        hints, slots = _hints(cls), []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            tp, meta = _split(hints[f.name])
            key = _marker(meta, Key)
            name = key.name if key else f.name
            optional = _optional(tp)
            marks = _marks(meta)
            slots.append(_Slot(f.name, name, f"{cls.__name__}.{name}", _reader(_unoptional(tp) if optional else tp, marks),
                               marks.codec, f.name in cls.REQUIRED or not _has_default(f),
                               optional and f.name not in cls.REQUIRED, cls.RANGES.get(f.name)))
        plan = _PLANS[cls] = _Plan(tuple(slots), frozenset([s.key for s in slots] + list(cls.TAGS)))
    return plan


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


def _unoptional(tp: Any) -> Any:
    return next(a for a in typing.get_args(tp) if a is not type(None))


class _Bad(Exception):
    """A value refused; ``rest`` is the sentence after its path, which the callers above prepend
    (an index, a field): paths are built only for a refusal, never for a value that reads."""

    def __init__(self, rest: str) -> None:
        super().__init__(rest)
        self.rest = rest


Reader = Callable[[Any], Any]
_READERS: Dict[Any, Reader] = {}


def _reader(tp: Any, marks: Optional[_Marks] = None) -> Reader:
    """The function that reads a (non-null) JSON value as ``tp`` with ``marks``: made once per
    annotation, so a document is read without looking at its annotations again."""
    if marks == _Marks():
        marks = None
    key = (tp, marks)
    r = _READERS.get(key)
    if r is None:
        r = _READERS[key] = _marked(tp, marks) if marks is not None else _make(tp)
    return r


def _marked(tp: Any, marks: _Marks) -> Reader:
    codec, text, items = marks.codec, marks.text, marks.items
    if codec is not None:
        def read_codec(v: Any) -> Any:
            try:
                return codec.read(v)
            except ValueError as exc:
                raise _Bad(f" {exc}") from None
        return read_codec
    inner = _reader(tp)
    pattern = re.compile(text.pattern) if text is not None and text.pattern else None

    def read_marked(v: Any) -> Any:
        out = inner(v)
        if text is not None:
            _text(text, pattern, out)
        if items is not None and not items.low <= len(out) <= items.high:
            raise _Bad(f" must hold {items.low} to {items.high} items, not {len(out)}")
        return out
    return read_marked


def _make(tp: Any) -> Reader:
    if tp in _WHAT:
        return lambda v: _load_scalar(tp, v)
    base, meta = _split(tp)
    if meta:  # an item's own markers (the strings of a list, each bounded)
        if _optional(base):
            return _nullable(_reader(_unoptional(base), _marks(meta)))
        return _reader(base, _marks(meta))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if type(None) not in args or len(args) != 2:
            raise TypeError(f"{tp!r}: only Optional[X] unions are supported")
        return _nullable(_reader(_unoptional(tp)))
    if tp is Any:
        return lambda v: v  # a sub-document read by its own checked parser (an error document)
    if isinstance(tp, type) and issubclass(tp, Document):
        return lambda v: _document(tp, v)
    if origin is dict:
        return _dict_reader(_reader(args[1]))
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return _tuple_reader(tuple(_reader(a) for a in args))
        return _list_reader(_reader(args[0]), origin is tuple)
    raise TypeError(f"no JSON reading of {tp!r}")


def _nullable(inner: Reader) -> Reader:
    return lambda v: None if v is None else inner(v)


def _document(tp: Type[Document], v: Any) -> Any:
    try:
        return tp._read(v)
    except _Refused as exc:
        raise _Bad(f": {exc}") from None


def _dict_reader(item: Reader) -> Reader:
    def read_dict(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _Bad(f" must be an object, not {_kind(v)}")
        out = {}
        for k, x in v.items():
            try:
                out[str(k)] = item(x)
            except _Bad as exc:
                raise _Bad(f"[{str(k)[:40]!r}]{exc.rest}") from None
        return out
    return read_dict


def _list_reader(item: Reader, as_tuple: bool) -> Reader:
    def read_list(v: Any) -> Any:
        if not isinstance(v, list):
            raise _Bad(f" must be a list, not {_kind(v)}")
        try:
            out = [item(x) for x in v]
        except _Bad as exc:
            i = next(i for i, x in enumerate(v) if _refuses(item, x))
            raise _Bad(f"[{i}]{exc.rest}") from None
        return tuple(out) if as_tuple else out
    return read_list


def _refuses(read: Reader, v: Any) -> bool:
    try:
        read(v)
    except _Bad:
        return True
    return False


def _tuple_reader(items: Tuple[Reader, ...]) -> Reader:
    def read_tuple(v: Any) -> Any:
        if not isinstance(v, list):
            raise _Bad(f" must be a list, not {_kind(v)}")
        if len(v) != len(items):  # a fixed-length tuple: (key id, mac), (revision, time) ...
            raise _Bad(f" must be a list of {len(items)}, not of {len(v)}")
        out = []
        for i, (read, x) in enumerate(zip(items, v)):
            try:
                out.append(read(x))
            except _Bad as exc:
                raise _Bad(f"[{i}]{exc.rest}") from None
        return tuple(out)
    return read_tuple


def _text(rule: Text, pattern: "Optional[re.Pattern[str]]", v: str) -> None:
    if len(v) > rule.max_len:
        raise _Bad(f" is longer than {rule.max_len} characters")
    if rule.choices and v not in rule.choices:
        raise _Bad(f" must be one of {', '.join(rule.choices)}")
    if pattern is not None and not pattern.fullmatch(v):
        raise _Bad(" is malformed")


def _load_scalar(tp: Any, v: Any) -> Any:
    if tp is str:
        if isinstance(v, str):
            return v
    elif tp is bool:
        if isinstance(v, bool):
            return v
    elif isinstance(v, int) and not isinstance(v, bool):  # int or float
        if not -(1 << 63) <= v < 1 << 64:
            raise _Bad(" is out of range (a 64-bit integer or a finite number)")
        return v if tp is int else float(v)
    elif tp is float and isinstance(v, float):
        if not math.isfinite(v):
            raise _Bad(" is out of range (a 64-bit integer or a finite number)")
        return v
    raise _Bad(f" must be {_WHAT[tp]}, not {_kind(v)}")


_WHAT = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}

__all__ = ["Codec", "Document", "HEX", "Items", "JsonObject", "Key", "ProtocolError", "Text"]
