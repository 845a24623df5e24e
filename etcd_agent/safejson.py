"""JSON from files and the wire, bounded: a size limit, a nesting limit, no NaN/Infinity.

The one JSON reader of the agent: every document read from a file, a command's output, an etcd
value or the wire goes through ``loads`` (``tests/unit/test_json_readers.py`` holds that).

``json.loads`` recurses once per nesting level and raises RecursionError (not ValueError) on a
deeply nested document; a 235 KB manifest of brackets stopped every backup that way. ``loads``
measures the depth in one linear pass first, so hostile input is one ``ValueError`` with a reason.
Numbers are bounded too: ``1e400`` (Python reads it as infinity) and integers of more digits than
a 64-bit value has (a 400-digit "time" ended ``backup list`` in an OverflowError) are refused here,
so no reader meets a number no JSON writer of ours could have written.
"""
from __future__ import annotations

import json
import math
from typing import IO, Any, Dict, List, Tuple, Union

MAX_DEPTH = 32
MAX_INT_DIGITS = 20  # 2**64 - 1 has 20: every id, revision and size fits

# what an UnsafeJson is about (its ``kind``): callers that word it their own way read this
SIZE, ENCODING, DEPTH, SYNTAX = "size", "encoding", "depth", "syntax"


class UnsafeJson(ValueError):
    """The document is too big, too deep, or not JSON; the message says which. ``kind`` is one of
    SIZE, ENCODING, DEPTH, SYNTAX (not JSON, or a number or key refused); ``detail`` the reason
    without this module's framing."""

    def __init__(self, message: str, kind: str = SYNTAX, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail or message


def _depth(text: str, limit: int) -> None:
    depth = 0
    in_string = False
    escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                raise UnsafeJson(f"nested deeper than {limit} levels", DEPTH)
        elif ch in "]}":
            depth -= 1


def _no_constants(name: str) -> Any:
    raise UnsafeJson(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UnsafeJson(f"an integer of {len(text.lstrip('-'))} digits, more than the {MAX_INT_DIGITS} allowed")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise UnsafeJson(f"the number {text[:40]} is out of range")
    return v


def _unique(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise UnsafeJson(f"duplicate key {k!r}")
        out[k] = v
    return out


def loads(data: Union[bytes, str], *, max_bytes: int, max_depth: int = MAX_DEPTH, unique_keys: bool = False) -> Any:
    """Parse ``data`` as JSON within the limits; UnsafeJson (a ValueError) otherwise.
    ``unique_keys``: an object naming a key twice is refused (which one counts is the reader's
    guess: Go's takes the last, so does Python's)."""
    if len(data) > max_bytes:
        raise UnsafeJson(f"{len(data)} bytes, more than the {max_bytes} allowed", SIZE)
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnsafeJson(f"not UTF-8 ({exc.reason} at byte {exc.start})", ENCODING) from None
    else:
        text = data
    _depth(text, max_depth)
    try:
        return json.loads(text, parse_constant=_no_constants, parse_int=_int, parse_float=_float,
                          object_pairs_hook=_unique if unique_keys else None)
    except UnsafeJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise UnsafeJson(f"not valid JSON ({exc})", SYNTAX, str(exc)) from None


def load(fh: "IO[Any]", *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``loads`` of an open file (binary or text), read no further than one past ``max_bytes``."""
    return loads(fh.read(max_bytes + 1), max_bytes=max_bytes, max_depth=max_depth)
