"""``manage.py adopt_stock_queues``: move what a stock ``redis://`` deployment holds into fenced queues."""

from __future__ import annotations

import argparse
import json
from urllib.parse import urlsplit

import redis
from celery import current_app
from django.core.management.base import BaseCommand, CommandError
from kombu import Connection
from kombu.exceptions import OperationalError
from kombu.transport import redis as kombu_redis

from broker_ext.adoption import DEFAULT_BATCH, DEFAULT_LEDGER_TTL_S, Mover, MoveReport, QueueMove, StockBroker
from queueapp.broker_reads import BROKER_ERRORS, bounded_channel, broker_timeout
from queueapp.errors import BrokerUnavailable
from queueapp.management.names import broker_error
from queueapp.management.progress import progress_bar
from queueapp.ops.selection import parse_duration

#: URL schemes of the stock Kombu Redis transport.
STOCK_SCHEMES = ("redis", "rediss")
#: The stock channel's options (what ``redis://`` reads from ``broker_transport_options``).
STOCK_OPTIONS = frozenset(kombu_redis.Channel.from_transport_options)


class Command(BaseCommand):
    help = (
        "Move the messages a stock redis:// deployment still holds into the fenced queues of this "
        "project's broker, each once: every level of every queue list (every queue its binding tables name, "
        "or --queue), and unacked entries past the stock visibility_timeout (all of them with "
        "--include-unacked, once the stock workers are stopped). Priorities and ETAs are kept. Safe to stop "
        "and run again: nothing is moved twice. See the cutover runbook in docs/operations.md."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--from",
            dest="source",
            required=True,
            metavar="URL",
            help="the stock broker: redis://HOST:PORT/DB",
        )
        parser.add_argument("--queue", action="append", default=[], help="only this queue (repeatable)")
        parser.add_argument(
            "--include-unacked",
            action="store_true",
            help="move unacked entries whatever their age (the stock workers are stopped)",
        )
        parser.add_argument(
            "--transport-options",
            type=_options,
            default=None,
            metavar="JSON",
            help="the stock deployment's broker_transport_options (visibility_timeout, global_keyprefix, "
            "...); default: the redis:// options among this project's CELERY_BROKER_TRANSPORT_OPTIONS",
        )
        parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="messages per script call")
        parser.add_argument(
            "--ledger-ttl",
            type=_duration,
            default=DEFAULT_LEDGER_TTL_S,
            help="how long each fenced queue remembers which stock messages it took in (default 7d)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would move and what would stay"
        )
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the report as JSON")

    def handle(self, *args, **options) -> None:
        app = current_app._get_current_object()
        source = options["source"]
        if urlsplit(source).scheme not in STOCK_SCHEMES:
            raise CommandError(
                f"--from must be the stock broker's redis:// (or rediss://) URL, got {source!r}"
            )
        if options["batch"] < 1:
            raise CommandError("--batch must be at least 1")
        stock_options = options["transport_options"]
        if stock_options is None:
            given = app.conf.broker_transport_options or {}
            stock_options = {name: value for name, value in given.items() if name in STOCK_OPTIONS}
        timeout = broker_timeout()
        stock_connection = Connection(
            source,
            transport_options={**stock_options, "socket_timeout": timeout, "socket_connect_timeout": timeout},
        )
        try:
            # The stock Redis first, outside the fenced channel: bounded_channel remembers any error in its
            # block as an outage of the fenced broker, which would name the wrong Redis and fail the admin's
            # reads of a healthy broker for a while.
            stock_connection.ensure_connection(max_retries=0, timeout=timeout)  # once, bounded
            with bounded_channel(app) as fenced:
                try:
                    report = self._move(app, stock_connection, fenced, options)
                except BROKER_ERRORS as exc:
                    # Either Redis may have failed mid-move: the one that no longer answers is named, and
                    # only the fenced broker's failure is its outage.
                    if not _answers(stock_connection):
                        raise StockFailed(exc) from exc
                    raise
        except BrokerUnavailable as exc:
            raise broker_error(exc, "stopped (run it again: nothing moves twice): ") from exc
        except (StockFailed, OSError, OperationalError, redis.exceptions.RedisError) as exc:
            cause = exc.args[0] if isinstance(exc, StockFailed) else exc
            raise CommandError(
                f"the stock Redis at {_address(source)} failed: {cause!r}; stopped (run it again: nothing "
                "moves twice)"
            ) from exc
        finally:
            stock_connection.release()
        if options["as_json"]:
            self.stdout.write(json.dumps(report.as_dict()))
        else:
            self._write(report, source)

    def _move(self, app, stock_connection: Connection, fenced, options) -> MoveReport:
        exchanges = {(q.exchange.name, q.exchange.type) for q in app.amqp.queues.values() if q.exchange}
        stock = StockBroker(stock_connection.default_channel, exchanges)
        mover = Mover(
            stock,
            fenced,
            queues=options["queue"] or None,
            include_unacked=options["include_unacked"],
            ledger_ttl_s=options["ledger_ttl"],
            batch=options["batch"],
        )
        queues, _ = mover.queue_names()
        label = "counting" if options["dry_run"] else "moving"
        with progress_bar(self.stderr, mover.total(queues), label) as advance:
            mover.progress = advance or mover.progress
            return mover.survey() if options["dry_run"] else mover.run()

    def _write(self, report: MoveReport, source: str) -> None:
        how = (
            "one script per message (one Redis)"
            if report.same_server
            else "through the stock server's journal"
        )
        unacked = (
            "any age"
            if report.include_unacked
            else f"past visibility_timeout ({report.visibility_timeout:g} s)"
        )
        self.stdout.write(f"from {_address(source)}, {how}; unacked entries: {unacked}")
        if report.journal:
            verb = "to finish first" if report.dry_run else "finished first"
            self.stdout.write(f"journal of an earlier, stopped run: {report.journal} messages {verb}")
        for name in sorted(report.queues):
            self.stdout.write(_queue_line(report.queues[name], report.dry_run))
            for reason, count in sorted(report.queues[name].left.items()):
                self.stdout.write(f"  stays {count}: {reason}")
        for what, count in sorted(report.stray.items()):
            self.stdout.write(f"stays {count}: {what}")
        for name in report.unbound_lists:
            self.stdout.write(f"not moved: list {name!r}, which no binding names (give it with --queue)")
        moved = sum(move.moved for move in report.queues.values())
        verb = "would move" if report.dry_run else "moved"
        summary = f"{moved} {verb}, {report.left} {'stays' if report.left == 1 else 'stay'} in the stock keys"
        self.stdout.write(self.style.SUCCESS(summary) if not report.left else summary)


def _queue_line(move: QueueMove, dry_run: bool) -> str:
    parts = [f"{move.queue}: {'would move' if dry_run else 'moved'} {move.moved}"]
    details = []
    if move.delayed:
        details.append(f"{move.delayed} with an ETA ahead")
    if move.from_unacked:
        details.append(f"{move.from_unacked} from unacked")
    if details:
        parts.append(f"({', '.join(details)})")
    if move.absorbed:
        parts.append(f"; {move.absorbed} moved before (taken out, stored once)")
    if move.gone:
        parts.append(f"; {move.gone} taken by stock workers meanwhile")
    return " ".join(parts).replace(" ;", ";")


class StockFailed(Exception):
    """The stock Redis failed mid-move (``args[0]``: its error); not an outage of the fenced broker."""


def _answers(connection: Connection) -> bool:
    """Whether a Redis still answers a PING on a new connection, within the connection's socket timeout."""
    try:
        with connection.clone() as probe:
            probe.default_channel.client.ping()
    except (OSError, OperationalError, redis.exceptions.RedisError):
        return False
    return True


def _address(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}{parts.path or '/0'}"


def _options(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(value) - STOCK_OPTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(f"not options of the stock redis:// transport: {', '.join(unknown)}")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text).total_seconds()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
