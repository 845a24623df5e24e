"""The daemon's newest full backup holds the cluster's current membership: the comparison of the
member list with a backup's snapshot members (``continuous.membership``, pure) and what the
supervisor decides from it (``decision.decide``)."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Dict

from etcd_agent.continuous.decision import Facts, Full, decide
from etcd_agent.continuous.membership import HALF_DONE_WAIT, Seat, compare, fingerprint
from etcd_agent.etcd.client import MemberInfo

FULL = Full("etcd-2026-12-01-10-00-00.tar", "/b/etcd-2026-12-01-10-00-00.tar", 100, 1_800_000_000.0)
P1, P2, P3 = "http://10.0.0.1:2380", "http://10.0.0.2:2380", "http://10.0.0.3:2380"


def live(i: int, name: str, peer: str, *, learner: bool = False) -> MemberInfo:
    return MemberInfo(i, name, (peer,), (peer.replace("2380", "2379"),) if name else (), learner)


def facts(**kw: Any) -> Facts:
    d: Dict[str, Any] = {"enabled": True, "restore_in_progress": False, "newest": FULL, "newest_unusable": "",
                         "watching_base": 100, "broken": "", "over_bounds": "", "retry_wait": False}
    d.update(kw)
    return Facts(**d)


def test_a_member_added_and_started_since_the_backup_is_a_change() -> None:
    held = (Seat(1, "ew1", (P1,)),)
    ch = compare([live(1, "ew1", P1), live(2, "ew2", P2)], held)
    assert ch.what == "membership changed: member ew2 added" and ch.half_done == ""


def test_added_but_not_started_is_half_done() -> None:
    ch = compare([live(1, "ew1", P1), live(2, "", P2)], (Seat(1, "ew1", (P1,)),))
    assert ch.what == f"membership changed: member 2 ({P2}) added" and "not started" in ch.half_done, ch


def test_removed_replaced_and_moved_members() -> None:
    held = (Seat(1, "ew1", (P1,)), Seat(2, "", (P2,)), Seat(3, "ew3", (P3,)))
    # ew3 removed (scale down)
    assert compare([live(1, "ew1", P1), live(2, "ew2", P2)], held).what == "membership changed: member ew3 removed"
    # ew2 replaced: a new id at the same peer URL
    ch = compare([live(1, "ew1", P1), live(9, "ew2", P2), live(3, "ew3", P3)], held)
    assert ch.what == "membership changed: member ew2 replaced (id 2 -> 9)", ch
    # ew3 moved to another peer URL (member update)
    ch = compare([live(1, "ew1", P1), live(2, "ew2", P2), live(3, "ew3", "http://10.0.0.4:2380")], held)
    assert ch.what == "membership changed: member ew3's peer URLs changed to http://10.0.0.4:2380", ch


def test_what_is_not_a_change() -> None:
    held = (Seat(1, "ew1", (P1,)), Seat(2, "", (P2,)))
    # a down member is still listed; names and learner flags are not compared (3.5.1-3.5.19 never
    # write a joined member's name or promotion into the db)
    assert compare([live(1, "ew1", P1), live(2, "ew2", P2, learner=True)], held).what == ""
    # a member added before the backup and not started yet: still the same layout
    assert compare([live(1, "ew1", P1), live(2, "", P2)], held).what == ""
    # etcd 3.4 keeps an earlier incarnation's members in the db after a restore: same peer URLs
    old = held + (Seat(7, "ew1", (P1,)), Seat(8, "ew2", (P2,)))
    assert compare([live(1, "ew1", P1), live(2, "ew2", P2)], old).what == ""
    # no id in common: the cluster was restored (or is another): the chain breaks for that
    assert compare([live(7, "ew1", P1), live(8, "ew2", P2)], held).what == ""
    # nothing known: no comparison
    assert compare([], held).what == "" and compare([live(1, "ew1", P1)], ()).what == ""


def test_ids_alone_when_the_backup_cannot_be_read_for_peer_urls() -> None:
    # a compressed or encrypted backup: its member ids as the writer found them in its db
    held = (Seat(1), Seat(2))
    assert compare([live(1, "ew1", P1), live(2, "ew2", P2)], held).what == ""
    assert compare([live(1, "ew1", P1)], held).what == "membership changed: member 2 removed"
    assert compare([live(1, "ew1", P1), live(2, "ew2", P2), live(3, "ew3", P3)], held).what == \
        "membership changed: member ew3 added"


def test_fingerprint_is_the_layout_not_the_order_names_or_learners() -> None:
    a = fingerprint([live(1, "ew1", P1), live(2, "", P2)])
    assert a == fingerprint([live(2, "ew2", P2, learner=True), live(1, "ew1", P1)])
    assert a != fingerprint([live(1, "ew1", P1)])


def test_decide_takes_a_full_backup_when_the_membership_changed() -> None:
    got, why = decide(facts(membership="membership changed: member ew3 added"))
    assert got == "backup" and why.startswith("membership changed: member ew3 added: a full backup"), why
    # before the watch starts too: a chain is not begun from a backup of a layout that is gone
    got, _ = decide(facts(membership="membership changed: member ew3 added", watching_base=None))
    assert got == "backup"


def test_decide_waits_for_a_half_done_change_but_keeps_the_chain_going() -> None:
    m = "membership changed: member 3 (http://10.0.0.3:2380) added"
    got, why = decide(facts(membership=m, membership_half_done="member 3 is added but not started yet",
                            half_done_for=10.0))
    assert got == "none" and "waits until it has started" in why, why
    got, _ = decide(facts(membership=m, membership_half_done="x", half_done_for=10.0, watching_base=None))
    assert got == "start", "no watch while a member is half-added would lose changes"
    # a member that never starts: backed up as etcd lists it, like a down one
    got, _ = decide(facts(membership=m, membership_half_done="x", half_done_for=HALF_DONE_WAIT))
    assert got == "backup"


def test_a_membership_that_flaps_backs_off() -> None:
    m = "membership changed: member ew3 removed"
    got, why = decide(facts(membership=m, breaks_in_row=3, backoff_left=50.0))
    assert got == "none" and "backing off" in why and "50s" in why, why
    got, _ = decide(facts(membership=m, breaks_in_row=3, backoff_left=0.0))
    assert got == "backup"
    # a break still comes first, a restore still stops everything
    assert decide(facts(membership=m, broken="the chain broke", watching_base=None))[1].startswith("the chain broke")
    assert decide(facts(membership=m, restore_in_progress=True))[0] == "stop"


def test_the_first_backup_is_taken_at_once() -> None:
    # no full backup yet: taken at once, whatever the membership (a degraded cluster is backed up)
    got, why = decide(facts(newest=None, watching_base=None, membership_half_done="x", half_done_for=0.0))
    assert got == "backup" and "no full backup" in why


def test_the_supervisor_counts_a_change_once_and_never_loops_on_a_backup_that_still_differs(tmp_path: Any) -> None:
    """The supervisor's bookkeeping (``_follow_membership``): a change counted once (for the
    backoff) however many ticks see it; once a full backup was taken for a member list, a snapshot
    that still differs from it asks for no other until the list changes."""
    from etcd_agent.continuous.supervisor import DeltaSupervisor

    path = tmp_path / "etcd-2026-12-01-10-00-00.tar"
    path.write_bytes(b"not a tar: its members are the ids the check cache holds")
    s = DeltaSupervisor(lambda: (None, None))  # type: ignore[arg-type,return-value]  # never ticked
    s._newest = Full(path.name, str(path), 100, 0.0, member_ids=("1",))
    grown = [live(1, "ew1", P1), live(2, "ew2", P2)]
    s.saw_members(grown)
    for _ in range(3):
        assert s._follow_membership().what == "membership changed: member ew2 added"
    assert s._breaks_in_row == 1 and s._members.pending
    # the full backup taken for it (as _full_backup leaves things), its snapshot still without ew2
    s._members.backed_up(for_change=True)
    s._last_chain_backup = s._chain_started = time.monotonic()  # and the new chain started from it
    assert s._follow_membership().what == "" and s._breaks_in_row == 1 and not s._members.pending
    # the list changes again: a change again, counted
    s.saw_members(grown + [live(3, "ew3", P3)])
    assert s._follow_membership().what.startswith("membership changed: member ew2 added; member ew3 added")
    assert s._breaks_in_row == 2 and s._backoff_left() > 0, "soon after the last one: backing off"
    # no member list (the cluster did not answer): nothing compared, nothing decided
    s.saw_members(None)
    assert s._follow_membership().what == ""


def test_a_held_membership_backup_says_why_in_the_status_detail() -> None:
    from etcd_agent.continuous.supervisor import DeltaSupervisor

    s = DeltaSupervisor(lambda: (None, None))  # type: ignore[arg-type,return-value]  # never ticked
    f = facts(membership="membership changed: member 3 added", membership_half_done="member 3 is added but not "
              "started yet", half_done_for=5.0)
    action, why = decide(f)
    s.watcher = SimpleNamespace()  # type: ignore[assignment]  # the chain runs on meanwhile
    s._hold(action, why, f)
    assert action == "none" and s._detail == why and "waits until it has started" in s._detail
