"""Pure quorum arithmetic for membership changes. Learners do not vote and are not counted."""
from __future__ import annotations

from typing import Tuple


def quorum(voters: int) -> int:
    """Members needed for a majority of ``voters``."""
    return voters // 2 + 1


def has_quorum(voters: int, healthy_voters: int) -> bool:
    return voters > 0 and healthy_voters >= quorum(voters)


def can_add(voters: int, healthy_voters: int, *, learner: bool = False) -> Tuple[bool, str]:
    """A new voting member counts toward quorum before it has started: adding it to a cluster
    that has only a bare majority leaves the cluster unable to commit until it joins."""
    if not has_quorum(voters, healthy_voters):
        return False, f"the cluster has no quorum ({healthy_voters} of {voters} voting members healthy)"
    if learner:
        return True, "a learner does not vote: quorum is unchanged"
    if voters == 1 and healthy_voters == 1:
        # etcd's own exception: a one-member cluster may grow to two (it cannot commit again
        # until the new member has started, which is the very next step of a join)
        return True, "second member of a one-member cluster: etcd allows it; the join starts it next"
    need = quorum(voters + 1)
    if healthy_voters < need:
        return False, (
            f"with a new unstarted member {voters + 1} voters need {need} healthy, "
            f"only {healthy_voters} are: fix the unhealthy members first"
        )
    return True, f"{healthy_voters} healthy of {voters + 1} voters after the add (quorum {need})"


def can_remove(voters: int, healthy_voters: int, *, target_is_voter: bool, target_healthy: bool) -> Tuple[bool, str]:
    """Removing must leave a cluster that still has quorum, and never removes the last voter."""
    if not target_is_voter:
        return True, "a learner does not vote: quorum is unchanged"
    if voters <= 1:
        return False, "refusing to remove the last voting member of the cluster"
    after = voters - 1
    healthy_after = healthy_voters - (1 if target_healthy else 0)
    need = quorum(after)
    if healthy_after < need:
        return False, (
            f"after the removal {healthy_after} of {after} voting members would be healthy, "
            f"quorum needs {need}"
        )
    return True, f"{healthy_after} healthy of {after} voters after the removal (quorum {need})"
