"""What a stored Kombu payload says about its Celery task, decoded as far as it goes (for the admin)."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class MessageInfo:
    """What a stored Kombu payload says about its Celery task (for display and matching)."""

    task: str = ""
    task_id: str = ""
    args: list | None = None
    kwargs: dict | None = None
    decoded: dict | None = None  # the payload with its body decoded, for the raw view

    @property
    def readable(self) -> bool:
        return self.decoded is not None


def _decode_body(message: dict):
    """The Celery body (``[args, kwargs, embed]``) of a Kombu payload, or ``None`` if it is not JSON."""
    body, properties = message.get("body"), message.get("properties")
    if not isinstance(body, str):
        return None
    base64_encoded = isinstance(properties, dict) and properties.get("body_encoding") == "base64"
    try:
        return json.loads(base64.b64decode(body) if base64_encoded else body)
    except (ValueError, TypeError):
        return None


def describe_payload(payload: bytes | str | None) -> MessageInfo:
    """Decode a stored payload (Kombu JSON, body base64 of Celery's JSON) as far as it goes.

    A malformed body is exactly what the dead-letter set holds sometimes, so
    nothing here raises: what cannot be decoded is left out.
    """
    try:
        message = json.loads(payload) if payload is not None else None
    except ValueError:
        message = None
    if not isinstance(message, dict):
        return MessageInfo()
    headers = message.get("headers") if isinstance(message.get("headers"), dict) else {}
    body = _decode_body(message)
    if body is not None:
        message = {**message, "body": body}
    args, kwargs = (body[0], body[1]) if isinstance(body, list) and len(body) >= 2 else (None, None)
    return MessageInfo(
        task=str(headers.get("task") or ""),
        task_id=str(headers.get("id") or ""),
        args=args if isinstance(args, list) else None,
        kwargs=kwargs if isinstance(kwargs, dict) else None,
        decoded=message,
    )
