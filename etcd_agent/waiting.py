"""Retry policies, defined once. Only transient errors are retried, always within a deadline."""
from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from .errors import EtcdUnavailable, EtcdUnhealthyCluster

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def membership_change(deadline: float = 90.0) -> Callable[[F], F]:
    """For member add/remove: etcd refuses with "unhealthy cluster" until every member has been
    connected for 5 s (--strict-reconfig-check); a member that just restarted is briefly
    unreachable. Both pass; anything else is a real error and is raised at once."""
    return retry(  # type: ignore[return-value]
        retry=retry_if_exception_type((EtcdUnhealthyCluster, EtcdUnavailable)),
        wait=wait_exponential(multiplier=0.5, min=0.5, max=4),
        stop=stop_after_delay(deadline),
        before_sleep=before_sleep_log(log, logging.INFO),
        reraise=True,
    )
