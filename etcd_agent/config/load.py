"""TOML -> ``Config``: parse, build the frozen sections, validate, report *every* problem at once.

Nothing falls back silently: an unknown key or a wrong type is an error, not a default.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import typing
import unicodedata
from typing import Any, Dict, List, Optional, Tuple

from etcd_agent.config.model import (
    DEFAULT_PATH,
    SECTIONS,
    Config,
    EtcdSection,
    Member,
    MemberSection,
    TlsSection,
)
from etcd_agent.config.validation import validate
from etcd_agent.errors import ConfigError
from etcd_agent.fs import NotARegularFile, read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9
    import tomli as tomllib

# A config is a few KiB; anything near this is not one (and /dev/zero would never end).
MAX_CONFIG_BYTES = 1 << 20
# Every integer must fit etcd's and the OS's 64-bit fields; beyond that it is a typo, not a value.
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
_CHAR_NAMES = {"\n": "newline", "\r": "carriage return", "\t": "tab", "\0": "NUL", "\x1b": "escape"}


def control_char(value: str) -> Optional[str]:
    """The first character of ``value`` that has no place in a one-line setting, named; else None.

    Control characters (newline, NUL, ESC, C1 ...), line and paragraph separators (which
    ``str.splitlines`` honours) and invisible format characters such as bidi overrides: a value
    with one would break the rendered etcd.conf or disguise what an error message shows.
    """
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return _CHAR_NAMES.get(ch, f"U+{ord(ch):04X}")
    return None


def _is_str_tuple(hint: Any) -> bool:
    """``Tuple[str, ...]``: a TOML array of strings (``[backup] encrypt_to``)."""
    return typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, Ellipsis)


def _base_type(hint: Any) -> Any:
    """``Optional[X]`` -> X; anything else unchanged."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _shown(value: Any) -> str:
    """A short, one-line, safe rendering of a wrong value (containers by kind only: a deeply
    nested one cannot even be repr'd)."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _value_problem(value: Any, hint: Any) -> Optional[str]:
    """Why a value of the right type is still unusable, or None."""
    base = _base_type(hint)
    if isinstance(value, list):  # of strings (checked by _check_type): each one a one-line value
        for i, item in enumerate(value):
            bad = control_char(item)
            if bad:
                return (f"entry {i} contains a control character ({bad}); "
                        "a value must be one line of printable text")
        return None
    if isinstance(value, str):
        bad = control_char(value)
        if bad:
            return f"contains a control character ({bad}); a value must be one line of printable text"
    elif isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    elif isinstance(value, int) and not isinstance(value, bool) and base in (int, float):
        if not INT_MIN <= value <= INT_MAX:
            return "is out of range: more than a 64-bit integer holds"
    return None


def _check_type(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_check_type(value, a) for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if _is_str_tuple(hint):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return False


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if _is_str_tuple(hint):
        return "a list of strings"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, str(hint)
    )


def _build(cls: type, raw: Any, where: str, errors: List[str]) -> Any:
    """Build dataclass ``cls`` from ``raw``; unknown keys and wrong types become errors."""
    if not isinstance(raw, dict):
        errors.append(f"{where}: expected a table")
        return None
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: Dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            errors.append(f"{where}: unknown key {key!r}")
            continue
        if dataclasses.is_dataclass(hints[key]):
            # a nested table such as [backup.remote]: built (and its errors reported) recursively
            sub = _build(hints[key], value, f"{where}.{key}", errors)
            if sub is not None:
                kwargs[key] = sub
            continue
        if not _check_type(value, hints[key]):
            # never echo a secret: hidden fields, and an age secret key pasted where a recipient goes
            secret = not known[key].repr or (isinstance(value, str) and "age-secret-key-" in value.lower())
            shown = "<hidden>" if secret else _shown(value)
            errors.append(f"{where}.{key}: expected {_type_name(hints[key])}, got {shown}")
            continue
        problem = _value_problem(value, hints[key])
        if problem:  # rejected like a wrong type: one error for this value, never echoed
            errors.append(f"{where}.{key}: {problem}")
            continue
        kwargs[key] = float(value) if hints[key] is float else tuple(value) if isinstance(value, list) else value
    missing = [
        n
        for n, f in known.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and n not in kwargs
        and n not in raw
    ]
    for n in missing:
        errors.append(f"{where}: missing required key {n!r}")
    if missing or any(k not in kwargs for k in raw if k in known):
        return None
    return cls(**kwargs)


def parse_text(text: str, *, path: Optional[str] = None) -> Tuple[Optional[Config], List[str]]:
    """Parse TOML text into a Config; returns (config or None, every error found)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, [f"not valid TOML: {exc}"]
    except RecursionError:  # tomllib recurses per nesting level of arrays and inline tables
        return None, ["not valid TOML: values nested too deeply"]
    except ValueError as exc:  # e.g. an integer of more than 4300 digits, raised by int() itself
        return None, [f"not valid TOML: {str(exc).split(':')[0]}"]
    errors: List[str] = []
    sections: Dict[str, Any] = {}
    for key in raw:
        if key not in SECTIONS and key != "member":
            errors.append(f"unknown section [{key}]" if key.isprintable() else f"unknown section {key!r}")
    for key, cls in SECTIONS.items():
        sections[key] = _build(cls, raw.get(key, {}), key, errors)
    raw_members = raw.get("member", [])
    member_sections: List[MemberSection] = []
    if not isinstance(raw_members, list):
        errors.append("member: expected [[member]] tables")
    else:
        for i, rm in enumerate(raw_members):
            label = f"member[{i}]"
            if isinstance(rm, dict) and isinstance(rm.get("name"), str):
                label = f"member {rm['name']!r}"
            ms = _build(MemberSection, rm, label, errors)
            if ms is not None:
                member_sections.append(ms)
    if any(v is None for v in sections.values()):
        return None, errors
    members = _resolve_members(member_sections, sections["etcd"], sections["tls"], errors)
    cfg = Config(members=tuple(members), path=path, **sections)
    errors.extend(validate(cfg, raw_member_count=len(raw_members) if isinstance(raw_members, list) else 0))
    return cfg, errors


def _default_url(host: str, port: int, tls: bool) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{h}:{port}"


def _resolve_members(
    sections: List[MemberSection], etcd: EtcdSection, tls: TlsSection, errors: List[str]
) -> List[Member]:
    out = []
    for s in sections:
        out.append(
            Member(
                name=s.name,
                host=s.host,
                client_url=s.client_url or _default_url(s.host, etcd.client_port, tls.client_enabled),
                peer_url=s.peer_url or _default_url(s.host, etcd.peer_port, tls.peer_enabled),
                ssh_host=s.ssh_host or s.host,
            )
        )
    return out


def read_config(path: str) -> str:
    """The text of config file ``path``: a regular file (or a symlink to one) of at most
    MAX_CONFIG_BYTES, in UTF-8. Anything else is one ConfigError sentence, never a hang."""
    try:
        data = read_regular(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (use -c PATH, or `etcd-agent config sample`)") from None
    except NotARegularFile as exc:
        raise ConfigError(f"config file {path} {exc.strerror}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    return decode_config(data, f"config file {path}")


def decode_config(data: bytes, where: str) -> str:
    """``data`` as config text; ``where`` names it in the one-sentence ConfigError."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (at byte offset {exc.start})") from None


def load(path: str = DEFAULT_PATH, *, text: Optional[str] = None) -> Config:
    """Load and validate; raise ConfigError listing every problem."""
    if text is None:
        text = read_config(path)
    cfg, errors = parse_text(text, path=path)
    if errors or cfg is None:
        n = len(errors)
        raise ConfigError(f"{path}: {n} problem{'s' if n != 1 else ''} in the config", details=errors)
    return cfg


