"""Exceptions of the fenced transport: one root, at most two levels."""

from __future__ import annotations


class FencedError(Exception):
    """Root of the fenced transport's exceptions."""


class ScriptRefused(FencedError):
    """Raised when a script refuses its input (bad argument, wrong key type) and wrote nothing."""


class StaleToken(FencedError):
    """Raised when an operation presented a fencing token that is no longer current."""


class PublishRefused(FencedError):
    """Raised when Redis refused a publish (out of memory, wrong type); nothing was stored."""


class MalformedMessage(FencedError):
    """Raised when a stored body cannot be decoded; the message is dead-lettered."""
