"""Exceptions of the lab package."""


class LabError(Exception):
    """Root of the lab's exceptions."""


class RedisServerError(LabError):
    """Raised when a private redis-server cannot be found, started or reached."""
