"""``{% load queueapp_admin %}``: cells of queueapp's pages written as its admin columns write them.

``{{ value|moment }}`` writes a moment (:func:`queueapp.times.moment`);
``{{ key|key }}`` a key or an id that keeps its start and end
(:func:`queueapp.admin.columns.key_cell`).
"""

from __future__ import annotations

from django import template

from queueapp import times
from queueapp.admin.columns import key_cell

register = template.Library()


@register.filter
def moment(value) -> str:
    """``2026-12-05 16:47:47``; ``-`` for nothing."""
    return times.moment(value) if value else "-"


@register.filter
def key(value) -> str:
    """A key (or a task or message id) shortened in the middle, the whole of it on hover."""
    return key_cell(str(value)) if value else "-"
