"""Exceptions of queueapp: one root, at most two levels."""

from __future__ import annotations

from queueapp import times


class QueueappError(Exception):
    """Root of queueapp's exceptions."""


class ConfigurationError(QueueappError):
    """Raised when a ``QUEUEAPP`` setting or a decorator argument is invalid."""


class IdempotencyKeyError(QueueappError):
    """Raised when a key function fails or returns anything but a non-empty str of at most 255 characters."""


class DeliveryRefused(QueueappError):
    """Raised inside the task's transaction to roll its writes back: the delivery may not commit.

    Internal control flow of the commit rule; the task's caller never sees it.
    ``verdict`` is the :class:`~queueapp.models.TaskDelivery.Verdict` to log.
    """

    def __init__(self, verdict: str, detail: str) -> None:
        super().__init__(detail)
        self.verdict = verdict
        self.detail = detail


class MalformedDelivery(QueueappError):
    """Raised when a task message cannot be run under the commit rule as it is (a header, its arguments).

    Delivering it again cannot fix it: the worker rejects it without requeue,
    and the broker dead-letters it with this message as the reason.
    """


class OutboxError(QueueappError):
    """Raised when an outbox row cannot be written (unknown task, arguments not JSON)."""


class BrokerUnavailable(QueueappError):
    """Raised when an operator tool cannot reach the fenced broker (Redis down, or not ``fenced://``).

    ``address`` is the broker's ``host:port`` when known; ``since`` (UTC) when
    the operator tools first failed to reach it in the current outage;
    ``timeout`` (seconds) when the failure was Redis not answering in time.
    """

    def __init__(self, message: str, *, address: str = "", since=None, timeout: float | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.since = since
        self.timeout = timeout

    @property
    def terminal(self) -> str:
        """The line a management command ends with: "did not answer in N s" for a hung Redis."""
        if self.timeout is None or not self.address:
            return str(self)
        since = f" (unreachable since {times.moment_with_zone(self.since)})" if self.since else ""
        return f"Redis at {self.address} did not answer in {self.timeout:g} s{since}"
