"""Plain delta segments signed with the cluster's manifest key, and what a chain's signatures prove.

An encrypted segment's seal carries an HMAC (``segseal``); a plain segment carries one in its
footer, written by the daemon when it has the manifest key (``backup.keys``)::

    "signature": {"alg": "hmac-sha256", "key_id": <manifest key id>, "mac": <hex>}
    mac = HMAC-SHA256(key, DOMAIN || sha256(every byte before the FOOTER record) || footer JSON
                           without "signature", as the format writes it: sorted keys, no spaces)

so the MAC covers the header (chain id, seq, base, the previous segment's sha256), every record
and the footer. Since each header names the previous file's sha256, a segment whose signature
checks also vouches for every segment before it in its chain: what an attacker who can write to
the backup dir cannot make is a segment *after* the last signed one that a restore applies.

The chain rule (``weaker``): a segment less authenticated than one before it in its chain -
unsigned or signed with another key after one signed with this host's key, unsigned after a
signed one when this host has no key - is a forged tail, and the chain stops there; a signature
that does not match (``state`` "invalid") is ``SegmentForged``. ``verdict`` is what a restore
says about a chain's signatures and whether it refuses it: a chain that is not signed at all
(written before segments were signed, or without the key) only with ``--accept-unsigned-chain``.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from etcd_agent.chain.errors import SegmentForged
from etcd_agent.chain.segments import SegmentFooter, json_bytes

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.chain.segments import SegmentInfo

DOMAIN = b"etcd-agent-delta-segment-footer-v1\0"  # never a valid prefix of another signed thing
# how far a segment's origin is proven: "" not checked (headers and footers only)
RANK = {"unsigned": 0, "unknown-key": 1, "valid": 2}
ACCEPT_FLAG = "--accept-unsigned-chain"


def key_id(key: bytes) -> str:
    """A short public name for the manifest key (an HMAC of a constant: says nothing about the
    key). Manifests, encrypted seals and segment footers name their key by it."""
    return hmac.new(key, b"etcd-agent manifest key id", hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, before_footer: bytes, footer: SegmentFooter) -> str:
    body = json_bytes(footer.unsigned().to_json())
    return hmac.new(key, DOMAIN + before_footer + body, hashlib.sha256).hexdigest()


def sign(footer: SegmentFooter, key: bytes, before_footer: bytes) -> SegmentFooter:
    """``footer`` with its signature; ``before_footer``: sha256 (raw) of the bytes before it."""
    return footer.with_signature((key_id(key), _mac(key, before_footer, footer)))


def state(path: str, footer: SegmentFooter, before_footer: bytes, key: Optional[bytes]) -> str:
    """valid | unsigned | unknown-key (signed, not with ``key``, or no key here); a signature
    that does not match is SegmentForged (damage is caught by the digest before: this is an edit)."""
    sig = footer.signature
    if sig is None:
        return "unsigned"
    if key is None or sig[0] != key_id(key):
        return "unknown-key"
    if not hmac.compare_digest(_mac(key, before_footer, footer), sig[1]):
        raise SegmentForged(path, "its footer does not match its signature (manifest key): changed after it was "
                                  "written")
    return "valid"


def rank(info: "SegmentInfo") -> int:
    """How far ``info``'s origin is proven: its checked signature, else (headers and footers only)
    a footer that claims one counts as signed with an unknown key."""
    s = info.signature
    if s:
        return RANK[s]
    return RANK["unknown-key"] if info.footer.signature is not None else RANK["unsigned"]


def describe(info: "SegmentInfo") -> str:
    """``info``'s origin in a few words, for a plan's line."""
    return {RANK["valid"]: "signed with this host's manifest key", RANK["unknown-key"]: "signed with another key",
            RANK["unsigned"]: "not signed"}[rank(info)]


def weaker(info: "SegmentInfo", best: int) -> str:
    """Why ``info`` cannot follow segments of which the best was ``best`` ("" when it can)."""
    if not info.signature or RANK[info.signature] >= best:
        return ""
    what = {"unsigned": "not signed", "unknown-key": "not signed with this host's manifest key"}[info.signature]
    after = "signed with this cluster's manifest key" if best == RANK["valid"] else "signed"
    return (f"{what}, after segments {after}: a forged tail (or one written without the key), and nothing from it "
            "on is trusted")


def verdict(segments: Sequence["SegmentInfo"], have_key: bool, key_path: str, accept: bool
            ) -> Tuple[str, Optional[str]]:
    """(the plan's line about the chain's signatures, a refusal or None) for a restore replaying
    ``segments``. The newest checked one decides: by the rule above it is the best of them, and
    its signature covers the ones before it by their sha256 links."""
    checked = [s for s in segments if s.signature]
    if not checked:
        return "", None
    top = max(checked, key=lambda s: RANK[s.signature])
    signed = sum(1 for s in checked if s.signature != "unsigned")
    n = f"{len(checked)} segment(s) checked, {signed} signed"
    if top.signature == "valid":
        return (f"point in time: delta chain signed with this cluster's manifest key ({n}; the newest signed one "
                "covers every one before it by their sha256 links)"), None
    if top.signature == "unknown-key" and not have_key:
        return (f"point in time: delta chain signed, but the signatures could not be checked: this host has no "
                f"manifest key ({key_path}) ({n})"), None
    why = ("not signed (written before segments were signed, or without the manifest key)"
           if top.signature == "unsigned" else f"not signed with this host's manifest key ({key_path})")
    if accept:
        return f"point in time: delta chain {why}: nothing proves the daemon wrote it; accepted with {ACCEPT_FLAG} ({n})", None
    return "", (f"the delta chain is {why}: nothing proves this cluster's daemon wrote it rather than anyone who "
                f"can write to the backup dir ({n}); check it and pass {ACCEPT_FLAG} to restore it anyway; "
                "nothing touched")
