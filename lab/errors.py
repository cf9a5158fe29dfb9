"""Exceptions of the lab package."""


class LabError(Exception):
    """Root of the lab's exceptions."""


class RedisServerError(LabError):
    """Raised when a private redis-server cannot be found, started or reached."""


class ProxyError(LabError):
    """Raised when the fault proxy cannot start or is asked for a fault while not running."""


class FaultLabError(LabError):
    """Raised when a fault-lab run cannot be set up or is configured wrongly."""


class RunInterrupted(FaultLabError):
    """Raised when a fault-lab run was asked to stop (Ctrl-C) and has cleaned up."""
