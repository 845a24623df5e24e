"""What the delta supervisor keeps of the cluster's membership from one tick to the next
(``membership`` compares; this remembers): the member list the daemon's cycle handed over, the
newest full backup's snapshot members (read once per backup file), the difference between them
until a full backup holds the new list, how long a half-done change has waited, and the member
list the last full backup for a change was taken for - a snapshot that still differs from it
asks for no other until the list changes again, so a backup never follows every tick."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

from etcd_agent.continuous import membership
from etcd_agent.continuous.decision import Full
from etcd_agent.errors import AgentError
from etcd_agent.etcd.client import MemberInfo

log = logging.getLogger(__name__)

MEMBERS_FRESH = 120.0  # a member list the daemon asked longer ago than this is not compared


class MembershipTracker:
    """``saw`` (the daemon's thread) hands over a member list; ``follow`` (the supervisor's, each
    tick) compares it with the newest full backup's; ``backed_up`` after each full backup."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._mu = threading.Lock()  # ``saw`` comes from the daemon's thread
        self._seen: Tuple[Optional[Tuple[MemberInfo, ...]], float] = (None, 0.0)
        self._seats: Tuple[object, Tuple[membership.Seat, ...]] = (None, ())
        self.pending = ""  # how the members differ from the newest full backup's until one holds them
        self._fp: object = None  # the layout last compared
        self._done: object = None  # the layout the last full backup for a change was taken for
        self._half_done_since: Optional[float] = None
        self._said = ""

    def saw(self, members: Optional[Sequence[MemberInfo]]) -> None:
        """The member list the daemon's cycle asked (None: no member answered)."""
        with self._mu:
            self._seen = (tuple(members) if members is not None else None, self._clock())

    def follow(self, newest: Optional[Full], *, broken: bool) -> Tuple[membership.Change, bool]:
        """The cluster's members against ``newest``'s (``membership.compare``), and whether a new
        difference began now (``broken``: a break is counted already, its full backup holds the
        new membership as well), for the supervisor to count like a break so that a membership
        that keeps changing backs off."""
        with self._mu:
            live, seen = self._seen
        if live is not None and self._clock() - seen > MEMBERS_FRESH:
            live = None  # the daemon's cycle is stuck: nothing current to compare with
        seats = self._seats_of(newest) if newest is not None and live else ()
        change = membership.compare(live or (), seats)
        fp = membership.fingerprint(live or ())
        if change.what and fp == self._done:
            # a full backup was taken for exactly this member list and its snapshot still differs:
            # another one would too
            if self._said != change.what:
                log.warning("delta: %s, yet the full backup taken for this membership holds the same members; "
                            "not taking another until the membership changes", change.what)
                self._said = change.what
            change = membership.Change(half_done=change.half_done)
        began = bool(change.what and not self.pending and not broken and newest is not None)
        if began:
            assert newest is not None
            log.warning("delta: %s since %s; %s", change.what, newest.name,
                        f"half-done ({change.half_done}): the full backup waits until it has started" if
                        change.half_done else "a full backup of the new membership follows, and a new chain from it")
        elif not change.what and self.pending and live:
            log.info("delta: the cluster's membership is the newest full backup's again: no full backup for it")
        self.pending, self._fp = change.what, fp
        if change.what and change.half_done:
            self._half_done_since = self._clock() if self._half_done_since is None else self._half_done_since
        else:
            self._half_done_since = None
        return change, began

    def half_done_for(self) -> float:
        """Seconds the pending change has been half-done (0: it is not)."""
        return self._clock() - self._half_done_since if self._half_done_since is not None else 0.0

    def backed_up(self, for_change: bool) -> None:
        """A full backup was taken (``for_change``: for the pending change): compared again with
        it at the next tick; one taken for a change remembers the list it was taken for."""
        if for_change:
            self._done = self._fp
        self.pending = ""

    def _seats_of(self, full: Full) -> Tuple[membership.Seat, ...]:
        """The members of ``full``'s snapshot, read from its own db once per backup file: a plain
        one's pages in place (no key: the manifest's say-so is not what is read), else the ids its
        writer (or a verify) found there; () unknown."""
        try:
            st = os.stat(full.path)
            key: object = (full.path, st.st_size, st.st_mtime_ns, st.st_ino)
        except OSError:
            return ()
        if self._seats[0] == key:
            return self._seats[1]
        from etcd_agent.backup.reader import peek_archive

        seats: Tuple[membership.Seat, ...] = ()
        try:
            ident = peek_archive(full.path).identity
            if ident is not None:
                seats = tuple(membership.Seat(m.id, m.name, tuple(m.peer_urls)) for m in ident.members)
        except (AgentError, OSError) as exc:
            log.debug("delta: the members of %s not read: %s", full.name, exc)
        if not seats:
            try:
                seats = tuple(membership.Seat(int(x, 16)) for x in full.member_ids)
            except ValueError:
                seats = ()
        self._seats = (key, seats)
        return seats
