"""The copy queue (``bucket.copier.Copier``) as the delta supervisor keeps it: running while
``[backup.remote]`` is enabled, with continuous backup or without; a reload that enables,
changes or disables it takes effect at the supervisor's next tick, and says so."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional, Tuple

from etcd_agent.config import Config, Member

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.copier import Copier, CopyStatus

log = logging.getLogger(__name__)


class CopyQueue:
    """``follow`` each tick; ``nudge`` when something new is on disk; ``status``; ``stop``."""

    def __init__(self, source: Callable[[], Tuple[Config, Member]]) -> None:
        self._source = source
        self._copier: "Optional[Copier]" = None  # while [backup.remote] is enabled
        self._seen: object = None  # the [backup.remote] it runs with

    def follow(self, cfg: Config) -> None:
        """Started, told of a new ``[backup.remote]`` or stopped, as ``cfg`` says."""
        on = cfg.backup.remote.enabled
        why = "[backup.remote] {} by the reloaded config: " if self._seen is not None else "[backup.remote] {}: "
        if on and self._copier is None:
            from etcd_agent.bucket.copier import Copier

            self._copier = Copier(self._source)
            self._copier.start()
            log.info(why.format("enabled") + "every full backup, checkpoint and segment here is copied to %s",
                     _where(cfg))
        elif not on and self._copier is not None:
            self._copier.stop()
            self._copier = None
            log.info(why.format("disabled") + "nothing more is copied off-host")
        elif on and self._copier is not None and self._seen != cfg.backup.remote:
            log.info(why.format("changed") + "copies go to %s from now on (what it lacks is copied there; failed "
                     "copies are tried again now)", _where(cfg))
            self._copier.retry_now()
        self._seen = cfg.backup.remote

    def status(self) -> "Optional[CopyStatus]":
        """The copy queue's status (None while [backup.remote] is disabled)."""
        c = self._copier
        return c.status() if c is not None else None

    def nudge(self) -> None:
        """A new full backup, checkpoint or segment: the queue looks now, not at its next rescan."""
        if self._copier is not None:
            self._copier.nudge()

    def stop(self) -> None:
        if self._copier is not None:
            self._copier.stop()


def _where(cfg: Config) -> str:
    """The bucket and prefix copies go to, as the log names them (never a credential)."""
    from etcd_agent.bucket.client import expand_prefix

    r = cfg.backup.remote
    return f"s3://{r.bucket}/{expand_prefix(r.prefix, cfg.cluster.name)}"
