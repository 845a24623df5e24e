"""Running a ``DeltaWatcher``: on a thread of its own (``OnItsThread``), its lock and resume point, then one connection to the member
after another - a streaming watch, or with ``batch_seconds`` a short watch per batch - and the
reconnects between them, until the member has been out of reach for ``max_outage`` (the chain
breaks) or the watcher is stopped.

This side only connects, reads and waits, always with a deadline; what a response means for
the chain is the watcher's (``DeltaWatcher.on_response``), and so are the segment closes and
coverage checks it runs between reads (``DeltaWatcher.timers``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Optional

from etcd_agent.chain.errors import ChainBroken, DeltaError
from etcd_agent.chain.writer import remove_stale_temps
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.rpc import EtcdRpc, StreamEnded
from etcd_agent.fs import ensure_private_dir
from etcd_agent.state.locks import Holder, OperationLock

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.continuous.watcher import DeltaWatcher

log = logging.getLogger(__name__)

LOCK_NAME = ".delta-watcher.lock"


class OnItsThread:
    """``run(stop)`` on a thread of its own: ``start()``, ``stop()`` (ask it to end, and wait),
    ``join()`` (raise what ended it, if anything)."""

    thread_name = "run"

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name=self.thread_name, daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        try:
            self.run(self._stop)
        except BaseException as exc:  # surfaced by join()
            self._error = exc

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the watcher to close its segment and stop; raise what ended it, if anything."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise DeltaError(f"delta watcher did not stop within {timeout:g}s")
        if self._error is not None:
            raise self._error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class WatchRunner:
    """``DeltaWatcher.run``: the connections of one run of ``w``."""

    def __init__(self, w: "DeltaWatcher") -> None:
        self.w = w
        self._mono = w.monotonic
        self._outage_since: Optional[float] = None  # monotonic: since when no watch could be created

    def run(self, stop: threading.Event) -> None:
        w = self.w
        ensure_private_dir(w.out_dir)
        # the holder record tells a prune (another process) which chain is being written
        lock = OperationLock(os.path.join(w.out_dir, LOCK_NAME), "delta watch",
                             holder=Holder(base_revision=w.base_revision, endpoint=w.endpoint)).acquire()
        try:
            remove_stale_temps(w.out_dir)
            w.resume()
            self._loop(stop)
        except ChainBroken as exc:
            w.broken = exc
            w.state = "broken"
            log.error("%s", exc.message)
            raise
        finally:
            try:
                w.finish()
            finally:
                if w.state != "broken":
                    w.state = "stopped"
                lock.release()

    def _loop(self, stop: threading.Event) -> None:
        w, opt = self.w, self.w.opt
        backoff = 0.5
        while not stop.is_set():
            try:
                self._session(stop)
                return
            except ChainBroken:
                raise
            except EtcdError as exc:
                if "larger than max" in exc.message:
                    # etcd 3.5 sends a new watch's first catch-up batch (up to 1000 revisions)
                    # unfragmented; one bigger than we accept would come again on every retry
                    raise ChainBroken(
                        w.captured_revision + 1,
                        f"etcd's catch-up response exceeds {opt.max_message} bytes ({exc.message})",
                    ) from None
                w.state = "reconnecting"
                w.reconnects += 1
                w.close_open_segment()  # what was captured reaches the disk now, not after the outage
                now = self._mono()
                if self._outage_since is None:  # the last session had connected: a new outage
                    self._outage_since = now
                    backoff = 0.5
                down = now - self._outage_since
                if down >= opt.max_outage:
                    raise ChainBroken(
                        w.captured_revision + 1,
                        f"the member at {w.endpoint} could not be watched for {down:.0f}s ({exc.message})",
                    ) from None
                log.warning("delta watch on %s: %s; reconnecting from revision %d", w.endpoint, exc.message,
                            w.captured_revision + 1)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _session(self, stop: threading.Event) -> None:
        """One connection: a streaming watch, its responses handled on the stream's reader
        thread (under the watcher's lock) while this one runs the timers and waits, always with
        a deadline; or with ``batch_seconds`` a short watch per batch, read on this thread."""
        w, opt = self.w, self.w.opt
        rpc = EtcdRpc(
            w.endpoint, tls=w.tls, timeout=opt.rpc_timeout, max_message=opt.max_message,
            single_threaded_streams=True,
        )
        try:
            w.begin_session(rpc)
            if opt.batch_seconds > 0:
                self._batches(stop, rpc)
                return
            stream = self._open(rpc, progress_notify=True)
            try:
                while not stop.is_set():
                    if stream.done.wait(0.25):
                        raise stream.failure or StreamEnded("watch stream ended")
                    w.timers(rpc)
            finally:
                stream.close()
        finally:
            rpc.close()

    def _watching(self) -> None:
        """A watch was created: the member is reachable again."""
        self._outage_since = None
        self.w.state = "watching"

    def _open(self, rpc: EtcdRpc, *, progress_notify: bool) -> Any:
        """A streaming watch, once etcd has created it."""
        w = self.w
        create = w.next_watch(progress_notify=progress_notify)
        stream = rpc.watch(create, queue_size=w.opt.queue_size, handler=lambda raw: w.on_response(raw, rpc))
        try:
            self._await_created(stream)
        except BaseException:
            stream.close()
            raise
        self._watching()
        return stream

    def _batches(self, stop: threading.Event, rpc: EtcdRpc) -> None:
        """Every ``batch_seconds`` (sooner when a segment close is due): the timers, then a watch
        read on this thread until it has delivered the revision the member had when etcd
        created it (a new watch behind the store is caught up by etcd in messages of up to 1000
        revisions), then canceled. Nothing is missed between batches: each starts where the last
        one ended, and a revision compacted away meanwhile cancels the watch (ChainBroken, as on
        a reconnect)."""
        w, opt = self.w, self.w.opt
        limit = max(opt.progress_timeout, opt.rpc_timeout * 2)
        while not stop.is_set():
            began = self._mono()
            w.timers(rpc)
            create = w.next_watch(progress_notify=False)
            with contextlib.closing(rpc.watch_batch(create, timeout=limit)) as responses:
                for raw in responses:
                    w.on_response(raw, rpc)
                    if w.caught_up():
                        break
                else:
                    raise StreamEnded(f"watch stream from {w.endpoint} ended by the server")
            self._watching()
            w.timers(rpc)  # a close due at the revision just delivered happens now
            stop.wait(max(0.05, min(began + opt.batch_seconds, w.next_due()) - self._mono()))

    def _await_created(self, stream: Any) -> None:
        wait = max(self.w.opt.rpc_timeout * 2, 10.0)
        deadline = self._mono() + wait
        while not self.w.created:
            if stream.done.wait(0.05):
                raise stream.failure or StreamEnded("watch stream ended before it was created")
            if self._mono() > deadline:
                raise StreamEnded(f"etcd did not confirm the watch within {wait:g}s")
