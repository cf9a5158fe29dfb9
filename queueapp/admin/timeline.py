"""The detail page's picture of a key's life: one bar per delivery on a time axis, drawn as inline SVG.

Server-side and self-contained (no script, no stylesheet from elsewhere): each
bar runs from the delivery's start to its verdict (or to now while it has
none), coloured by verdict and labelled with its duration; a dashed tick marks
the lease deadline its claim set, and, where the broker's reclaim log has the
delivery, a tick marks its worker's last extend and a cross the moment its
lease expired. Every mark has a ``<title>`` with the exact time.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from queueapp import times
from queueapp.models import TaskDelivery
from queueapp.ops.diagnosis import Diagnosis

Verdict = TaskDelivery.Verdict

WIDTH = 1100
LABEL = 190  # the left column: "delivery 2 · worker"
RIGHT = 250  # room for the label after the last bar
ROW = 34
TOP = 10
AXIS = 30
TICKS = 6
#: Width of a character of the 12 px labels, rounded up (DejaVu Sans, the widest common sans): labels are
#: placed where this many pixels per character fit, so none runs past the picture's edge.
CHAR_PX = 7.2

COLOURS = {
    Verdict.EXECUTED: "#2e7d32",
    Verdict.SUPPRESSED_DUPLICATE: "#8e8e8e",
    Verdict.REFUSED_STALE: "#c62828",
    Verdict.DEFERRED: "#ef6c00",
    Verdict.RETRIED: "#f9a825",
    Verdict.FAILED: "#ad1457",
    Verdict.DEAD_LETTERED: "#4e342e",
    Verdict.STARTED: "#1565c0",
}


def _clock(moment: datetime, precise: bool) -> str:
    return times.clock(moment, tenths=precise)


def duration(seconds: float) -> str:
    """``0.3 s``, ``12 s``, ``4 min 5 s``: a bar's length as an operator reads it."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest} s"


def _ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class _Scale:
    """Maps moments to x positions over the span of every mark, with a little margin each side."""

    def __init__(self, marks: list[datetime]) -> None:
        # Pad a short span to a second, so a few milliseconds are not drawn across the whole axis.
        start, stop = min(marks), max(marks)
        span = max((stop - start).total_seconds(), 1.0)
        self.start = start - timedelta(seconds=span * 0.02)
        self.span = span * 1.04
        self.plot = WIDTH - LABEL - RIGHT
        self.precise = self.span < 20  # tenths of a second on a short axis

    def x(self, moment: datetime) -> float:
        return LABEL + (moment - self.start).total_seconds() / self.span * self.plot

    def axis(self, y: int) -> list[str]:
        parts = [f'<line x1="{LABEL}" x2="{LABEL + self.plot}" y1="{y}" y2="{y}" stroke="#999"/>']
        for i in range(TICKS + 1):
            moment = self.start + timedelta(seconds=self.span * i / TICKS)
            tx = self.x(moment)
            parts.append(
                f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{y}" y2="{y + 5}" stroke="#999"/>'
                f'<text class="qa-tick" x="{tx:.1f}" y="{y + 18}" text-anchor="middle" fill="#777" '
                f'font-size="11">{_clock(moment, self.precise)}</text>'
            )
        return parts


def _lease_end(diagnosis: Diagnosis, d: TaskDelivery) -> tuple[datetime | None, str]:
    """Where a delivery's lease line ends, and by whose record: ``expired`` (the broker's reclaim log),
    ``live`` (the broker's lease now, kept extended by its worker) or ``claim`` (the deadline its claim
    set, for a delivery without a verdict when the broker says nothing)."""
    entry = diagnosis.reclaim_of(d)
    if entry is not None:
        return _ms(entry.deadline_ms), "expired"
    live = diagnosis.live_lease_of(d)
    if live is not None:
        return live, "live"
    if d.finished_at is None and d.lease_deadline is not None:
        return d.lease_deadline, "claim"
    return None, ""


def _bar_end(diagnosis: Diagnosis, d: TaskDelivery, now: datetime) -> tuple[datetime, str]:
    """Where a delivery's bar ends, and its label (``{}``: the duration): its verdict; without one, the
    moment the records say its worker stopped (lease expired, or a later delivery took the key), else now."""
    took = "{}"
    if d.finished_at is not None:
        return d.finished_at, f"{d.get_verdict_display()} · {took}"
    entry = diagnosis.reclaim_of(d)
    if entry is not None:
        return _ms(entry.deadline_ms), f"no verdict: its worker stopped, lease expired after {took}"
    later = [o for o in diagnosis.deliveries if o.started_at > d.started_at and o.fence_token > d.fence_token]
    if later and diagnosis.live_lease_of(d) is None:
        return later[0].started_at, f"no verdict: a later delivery took the key after {took}"
    return now, f"no verdict yet · {took} so far"


def _lease_start(diagnosis: Diagnosis, d: TaskDelivery) -> datetime:
    """When the broker handed the delivery out, if its reclaim log says (a late worker logs it later)."""
    entry = diagnosis.reclaim_of(d)
    return min(d.started_at, _ms(entry.claimed_ms)) if entry is not None else d.started_at


def _marks(diagnosis: Diagnosis, now: datetime) -> list[datetime]:
    marks: list[datetime] = []
    for d in diagnosis.deliveries:
        marks += [d.started_at, _bar_end(diagnosis, d, now)[0], _lease_start(diagnosis, d)]
        end, _kind = _lease_end(diagnosis, d)
        if end is not None:
            marks.append(end)
    return marks


def _bar(
    n: int, d: TaskDelivery, y: int, scale: _Scale, end: datetime, label: str, label_x: float
) -> list[str]:
    x0 = scale.x(d.started_at)
    x1 = max(scale.x(end), x0 + 3)
    colour = COLOURS.get(d.verdict, "#555")
    retry = f" · retry {d.retries}" if d.retries else ""
    who = d.worker or "unknown worker"
    finished = f"finished {_clock(d.finished_at, True)}" if d.finished_at else "no verdict yet"
    title = (
        f"delivery {n}: {d.get_verdict_display()}; started {_clock(d.started_at, True)}, {finished}; "
        f"token {d.fence_token}, broker delivery {d.delivery_count or '?'}, worker {who}"
        + (f"; {d.detail}" if d.detail else "")
    )
    label = label.format(duration(max((end - d.started_at).total_seconds(), 0.0)))
    text = f"{_clock(d.started_at, scale.precise)} · {label}"
    x, y_label, anchor = _label_place(len(text) * CHAR_PX, x0, max(label_x, x1), y)
    return [
        f'<text x="4" y="{y + 17}" fill="currentColor">delivery {n}{escape(retry)}</text>'
        f'<text x="4" y="{y + 29}" fill="#777" font-size="10">{escape(who[:30])}</text>',
        f'<rect class="qa-bar qa-bar-{escape(d.verdict)}" data-delivery="{n}" x="{x0:.1f}" y="{y + 6}" '
        f'width="{x1 - x0:.1f}" height="16" rx="3" fill="{colour}"><title>{escape(title)}</title></rect>',
        f'<text class="qa-bar-label" x="{x:.1f}" y="{y_label}" text-anchor="{anchor}" fill="{colour}">'
        f"{escape(text)}</text>",
    ]


def _label_place(width: float, bar_start: float, marks_end: float, y: int) -> tuple[float, int, str]:
    """Where a bar's label goes so that it is never clipped: (x, baseline, text-anchor).

    After the bar and its lease marks when it fits there; else before the bar;
    else under the bar, pulled left as far as it must.
    """
    if marks_end + 8 + width <= WIDTH - 4:
        return marks_end + 8, y + 18, "start"
    if bar_start - 8 - width >= LABEL:
        return bar_start - 8, y + 18, "end"
    return max(LABEL, min(bar_start, WIDTH - 4 - width)), y + 33, "start"


def _lease_marks(diagnosis: Diagnosis, d: TaskDelivery, y: int, scale: _Scale) -> tuple[list[str], float]:
    """The lease line, last extend and expiry of a delivery; and the x where its marks end."""
    end, kind = _lease_end(diagnosis, d)
    if end is None:
        return [], 0.0
    start = _lease_start(diagnosis, d)
    x0, ex = scale.x(start), scale.x(end)
    held = (end - start).total_seconds()
    parts = [
        f'<line class="qa-held" x1="{x0:.1f}" x2="{ex:.1f}" y1="{y + 14}" y2="{y + 14}" stroke="#90a4ae" '
        f'stroke-width="2"><title>lease held {duration(held)}</title></line>'
    ]
    if kind == "live":
        parts.append(
            f'<line class="qa-live-lease" x1="{ex:.1f}" x2="{ex:.1f}" y1="{y + 2}" y2="{y + 26}" '
            f'stroke="#2e7d32" stroke-width="2"><title>lease extended by its worker, now until '
            f"{_clock(end, True)} (broker)</title></line>"
        )
        return parts, ex
    if kind == "claim":
        parts.append(
            f'<line class="qa-lease" x1="{ex:.1f}" x2="{ex:.1f}" y1="{y + 2}" y2="{y + 26}" '
            f'stroke="#1565c0" stroke-dasharray="3,2"><title>lease deadline set by the claim: '
            f"{_clock(end, True)} (extended in the broker while its worker lives)</title></line>"
        )
        return parts, ex
    entry = diagnosis.reclaim_of(d)
    if entry is not None and entry.extended:
        extended = _ms(entry.last_extended_ms)
        ax = scale.x(extended)
        parts.append(
            f'<line class="qa-extend" x1="{ax:.1f}" x2="{ax:.1f}" y1="{y + 4}" y2="{y + 24}" '
            f'stroke="#6a1b9a" stroke-width="2"><title>last lease extend: '
            f"{_clock(extended, True)}</title></line>"
        )
    parts.append(
        f'<path class="qa-expired" d="M{ex - 5:.1f},{y + 9} l10,10 m0,-10 l-10,10" stroke="#c62828" '
        f'stroke-width="2.5"><title>lease expired (broker): {_clock(end, True)}, '
        f"held {duration(held)}</title></path>"
    )
    return parts, ex + 5


def timeline_svg(diagnosis: Diagnosis, now: datetime | None = None) -> SafeString:
    """The SVG of ``diagnosis``'s deliveries (empty string when there is none)."""
    log = diagnosis.deliveries
    if not log:
        return mark_safe("")
    now = now or timezone.now()
    scale = _Scale(_marks(diagnosis, now))
    height = TOP + ROW * len(log) + AXIS
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="qa-timeline" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="timeline of {len(log)} deliveries" '
        'font-family="sans-serif" font-size="12">'
    ]
    for n, d in enumerate(log, 1):
        y = TOP + ROW * (n - 1)
        marks, marks_end = _lease_marks(diagnosis, d, y, scale)
        end, label = _bar_end(diagnosis, d, now)
        parts += marks
        parts += _bar(n, d, y, scale, end, label, marks_end)
    parts += scale.axis(TOP + ROW * len(log) + 4)
    parts.append("</svg>")
    return mark_safe("".join(parts))  # Every interpolated text is escaped above.
