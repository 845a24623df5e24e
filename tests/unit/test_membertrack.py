"""The supervisor's membership bookkeeping on its own (``continuous.membertrack``): what a change
is from one tick to the next - begun once, pending until a full backup holds it, never asked
again of a backup taken for the same member list, half-done for so long, not compared on a stale
member list - with a clock of the test's and a real backup file's member ids."""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

from etcd_agent.continuous.decision import Full
from etcd_agent.continuous.membertrack import MEMBERS_FRESH, MembershipTracker
from etcd_agent.etcd.client import MemberInfo

P1, P2, P3 = "http://10.0.0.1:2380", "http://10.0.0.2:2380", "http://10.0.0.3:2380"
ADDED = "membership changed: member ew2 added"


def live(i: int, name: str, peer: str) -> MemberInfo:
    return MemberInfo(i, name, (peer,), (peer.replace("2380", "2379"),) if name else (), False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backup(tmp_path: Path, *ids: str, body: bytes = b"not a tar: its members are the ids the check cache holds") -> Full:
    """A backup file whose snapshot cannot be read here: compared by the member ids its writer found."""
    path = tmp_path / "etcd-2026-12-01-10-00-00.tar"
    path.write_bytes(body)
    return Full(path.name, str(path), 100, 0.0, member_ids=ids)


def tracker() -> Tuple[MembershipTracker, Clock]:
    clock = Clock()
    return MembershipTracker(clock), clock


def test_a_change_begins_once_and_stays_pending_until_a_backup(tmp_path: Path) -> None:
    t, _ = tracker()
    full = backup(tmp_path, "1")
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    began: List[bool] = []
    for _ in range(3):
        change, b = t.follow(full, broken=False)
        assert change.what == ADDED and t.pending == ADDED
        began.append(b)
    assert began == [True, False, False], "counted once, however many ticks see it"
    # a break's full backup (not taken for the change): the list is not remembered, and a snapshot
    # that still differs from it is a change again, begun again
    t.backed_up(for_change=False)
    assert t.pending == ""
    change, b = t.follow(full, broken=False)
    assert change.what == ADDED and b and t.pending == ADDED


def test_a_backup_taken_for_the_list_asks_no_other_until_the_list_changes(tmp_path: Path) -> None:
    t, _ = tracker()
    full = backup(tmp_path, "1")
    grown = [live(1, "ew1", P1), live(2, "ew2", P2)]
    t.saw(grown)
    t.follow(full, broken=False)
    t.backed_up(for_change=True)
    # its snapshot still without ew2 (as etcd wrote it): no change, none begun, on every tick
    for _ in range(2):
        change, began = t.follow(full, broken=False)
        assert (change.what, began, t.pending) == ("", False, "")
    t.saw(list(reversed(grown)))  # the same layout in another order: still the same list
    assert t.follow(full, broken=False)[0].what == ""
    t.saw(grown + [live(3, "ew3", P3)])
    change, began = t.follow(full, broken=False)
    assert began and change.what == "membership changed: member ew2 added; member ew3 added"


def test_a_break_or_no_backup_begins_nothing(tmp_path: Path) -> None:
    t, _ = tracker()
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    # a break is counted already (its full backup holds the new membership as well)
    change, began = t.follow(backup(tmp_path, "1"), broken=True)
    assert change.what == ADDED and not began and t.pending == ADDED
    # no full backup, or one whose file is gone: nothing to compare with
    t2, _ = tracker()
    t2.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    assert t2.follow(None, broken=False)[0].what == ""
    assert t2.follow(Full("gone.tar", str(tmp_path / "gone.tar"), 1, 0.0, member_ids=("1",)), broken=False)[0].what == ""


def test_a_stale_or_missing_member_list_is_not_compared(tmp_path: Path) -> None:
    t, clock = tracker()
    full = backup(tmp_path, "1")
    t.follow(full, broken=False)
    assert t.pending == "", "no list handed over yet"
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    clock.now += MEMBERS_FRESH + 1  # the daemon's cycle is stuck
    assert t.follow(full, broken=False)[0].what == "" and t.pending == ""
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    assert t.follow(full, broken=False)[0].what == ADDED
    t.saw(None)  # no member answered
    assert t.follow(full, broken=False)[0].what == "" and t.pending == ""


def test_half_done_for_counts_from_the_first_tick_that_saw_it(tmp_path: Path) -> None:
    t, clock = tracker()
    full = backup(tmp_path, "1")
    t.saw([live(1, "ew1", P1), live(2, "", P2)])  # added, not started: no name yet
    change, _ = t.follow(full, broken=False)
    assert "not started" in change.half_done and t.half_done_for() == 0.0
    clock.now += 40
    t.follow(full, broken=False)
    assert t.half_done_for() == 40.0
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])  # it started
    change, began = t.follow(full, broken=False)
    assert change.what == ADDED and change.half_done == "" and not began and t.half_done_for() == 0.0


def test_a_backups_members_are_read_once_per_file(tmp_path: Path) -> None:
    t, _ = tracker()
    t.saw([live(1, "ew1", P1), live(2, "ew2", P2)])
    assert t.follow(backup(tmp_path, "1"), broken=False)[0].what == ADDED
    # the same file (unchanged): its members as first read, whatever the catalog says now
    same = Full("etcd-2026-12-01-10-00-00.tar", str(tmp_path / "etcd-2026-12-01-10-00-00.tar"), 100, 0.0,
                member_ids=("1", "2"))
    assert t.follow(same, broken=False)[0].what == ADDED
    # the file rewritten: read again
    assert t.follow(backup(tmp_path, "1", "2", body=b"another backup under the same name"), broken=False)[0].what == ""
