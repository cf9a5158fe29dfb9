"""``{% load queueapp_admin %}``: cells of queueapp's pages written as its admin columns write them.

``{{ value|moment }}`` writes a moment (:func:`queueapp.times.moment`);
``{{ key|key }}`` a key or an id that keeps its start and end
(:func:`queueapp.admin.columns.key_cell`; ``{{ key|key:48 }}`` keeps 48 characters).
"""

from __future__ import annotations

from django import template

from queueapp import times
from queueapp.admin.columns import KEY_CHARS, key_cell

register = template.Library()


@register.filter
def moment(value) -> str:
    """``2026-12-05 16:47:47``; ``-`` for nothing."""
    return times.moment(value) if value else "-"


@register.filter
def key(value, length: int = KEY_CHARS) -> str:
    """A key (or a task or message id) shortened in the middle to ``length``, the whole of it on hover."""
    return key_cell(str(value), int(length)) if value else "-"
