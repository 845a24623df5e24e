"""When the replayed db is worth a defragmentation (pure rule; the real replays that take each
branch are in tests/integration/delta/test_replay_defragment.py)."""
import pytest

from etcd_agent.pitr.replayrun import _worth_defragmenting


@pytest.mark.parametrize("size, in_use, worth", [
    (10_399_744, 2_084_864, True),   # overwritten and compacted: 80 % free
    (2_125_824, 2_072_576, False),   # written once: 2.5 % free
    (100, 50, False),                # exactly half free: not rewritten
    (100, 49, True),
    (0, 0, True),                    # a status that makes no sense: defragmented, as before the rule
    (100, 0, True),
    (100, 101, True),
])
def test_defragmented_only_when_more_than_half_is_free(size: int, in_use: int, worth: bool) -> None:
    assert _worth_defragmenting(size, in_use) is worth
