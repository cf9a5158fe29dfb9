"""Cells the admins share: keys that rows can be told apart by, and moments in queueapp's one format.

Keys are often long and alike at the start (``fl-20261205-164008-s0-fenced-…``,
``invoice:2026-12-04:customer-…``): what tells two rows apart is the end, so a
long key keeps its start and its end and loses its middle (the whole key is
the cell's title, and the search box finds it). Moments are written by
:func:`queueapp.times.moment` on every page, never in the locale's
``DATETIME_FORMAT``: a datetime field is shown through :func:`moment_column`,
whose help text :func:`described_form` keeps on the detail page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django import forms
from django.contrib import admin
from django.utils.html import format_html

from queueapp import times

#: Characters a key (or another identifier) keeps in a table cell; its end is kept, the middle dropped.
KEY_CHARS = 28
#: Of those, the characters kept from its start.
KEY_HEAD = 8
ELLIPSIS = "\u2026"


def middle_shortened(text: str, length: int = KEY_CHARS, head: int = KEY_HEAD) -> str:
    """``text`` with its middle dropped to fit ``length`` characters: its start and its end kept."""
    if len(text) <= length:
        return text
    return text[:head] + ELLIPSIS + text[-(length - head - 1) :]


def key_cell(key: str, length: int = KEY_CHARS) -> str:
    """A key (or a task or message id) in a table cell: its start and end, the whole of it on hover."""
    return format_html('<span class="qa-key" title="{}">{}</span>', key, middle_shortened(key, length))


def end_shortened(text: str, length: int, *, title: str | None = None) -> str:
    """Prose (an error's first line) cut at ``length`` characters; the whole text on hover."""
    shown = text if len(text) <= length else text[: length - 1] + ELLIPSIS
    return format_html('<span title="{}">{}</span>', title if title is not None else text, shown)


def moment_column(model, name: str) -> Callable:
    """A display method for the datetime field ``name``: sortable, labelled as the field, one format."""
    field = model._meta.get_field(name)

    @admin.display(description=field.verbose_name, ordering=name)
    def show(model_admin, obj) -> str:
        return times.moment(getattr(obj, name))

    show.__name__ = f"{name}_shown"
    show.field_name = name
    return show


def described_form(model, columns: Iterable[Callable]) -> type[forms.ModelForm]:
    """A model form that gives :func:`moment_column` fields their model field's help text."""
    help_texts = {c.__name__: model._meta.get_field(c.field_name).help_text for c in columns}
    meta = type("Meta", (), {"model": model, "fields": [], "help_texts": help_texts})
    return type(f"{model.__name__}ReadOnlyForm", (forms.ModelForm,), {"Meta": meta})
