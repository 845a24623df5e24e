"""Lock release retries (logic only: a stand-in lock whose calls fail as a real one did in CI,
"etcd connection timeout" right after a member was removed)."""
from etcd_agent.etcd.client import EtcdClient
from tests.harness.fakes import FakeClock


class FlakyLock:
    def __init__(self, release_failures: int, revoke_works: bool = True) -> None:
        self.release_failures = release_failures
        self.revoke_works = revoke_works
        self.calls = []
        lock = self

        class Lease:
            def revoke(self) -> None:
                lock.calls.append("revoke")
                if not lock.revoke_works:
                    raise RuntimeError("etcd connection timeout")

        self.lease = Lease()

    def release(self) -> bool:
        self.calls.append("release")
        if self.release_failures > 0:
            self.release_failures -= 1
            raise RuntimeError("etcd connection timeout")
        return True


def test_release_retried_until_it_works():
    lock = FlakyLock(release_failures=2, revoke_works=False)
    clock = FakeClock()
    EtcdClient(["http://127.0.0.1:1"])._release(lock, "x", deadline=2, clock=clock)
    assert lock.calls == ["release", "revoke", "release", "revoke", "release"]
    assert clock.sleeps == [0.3, 0.3]


def test_failed_release_falls_back_to_revoking_the_lease():
    lock = FlakyLock(release_failures=5)
    EtcdClient(["http://127.0.0.1:1"])._release(lock, "x", deadline=2, clock=FakeClock())
    assert lock.calls == ["release", "revoke"]


def test_gives_up_after_the_deadline_with_a_warning(caplog):
    lock = FlakyLock(release_failures=10**6, revoke_works=False)
    clock = FakeClock()
    EtcdClient(["http://127.0.0.1:1"])._release(lock, "x", deadline=1.0, clock=clock)
    assert "releasing lock x failed" in caplog.text
    assert lock.calls.count("revoke") == lock.calls.count("release") >= 3
    assert abs(sum(clock.sleeps) - 1.0) < 1e-9  # the whole deadline waited, on the fake clock
