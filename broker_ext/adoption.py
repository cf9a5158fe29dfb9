"""Moving a running stock deployment's messages into fenced queues: the cutover from ``redis://``.

Stock Kombu's Redis transport keeps a deployment's messages in its queue lists
(one per priority level) and, once delivered, in the ``unacked`` hash with its
``unacked_index`` (an ETA task held in a worker's memory is there too, until
that worker stops and gives it back to the lists, or dies). :class:`StockBroker`
reads them as the stock channel names them, with the stock channel's own
options (``global_keyprefix``, ``sep``, the ``unacked_*`` keys,
``visibility_timeout``), and :class:`Mover` moves each message into the fenced
queue of the same name, priority and ETA kept, so that a move stopped at any
point (killed, Redis gone) and run again loses nothing and stores nothing twice:

* stock and fenced keys in one Redis database: ``adopt_local.lua`` takes each
  entry out and stores it in one atomic step;
* two servers (or databases): ``adopt_take.lua`` moves each entry into a
  journal on the stock server (atomically: no stock worker can pop it any
  more, and nothing is lost if the move stops there), ``adopt.lua`` stores it
  on the fenced server, then its journal field is deleted; a move finishes an
  earlier run's journal first.

Either way a message is stored once per *stock publish id*, its Kombu delivery
tag (the same on every stock redelivery, different for every publish): each
fenced queue keeps a ledger of the ids it took in (``fenced:{q}:adopted``), so
a message moved again, by a later run or found twice in the stock keys (a
resent ``LPUSH``), stores nothing. An unacked entry moves once its
``visibility_timeout`` has passed (when stock's own ``restore_visible`` would
restore it), or at any age with ``include_unacked``, once the stock workers are
stopped.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import redis

from broker_ext.errors import MessageTooLarge, Reply
from broker_ext.keys import adopting_key
from broker_ext.messages import derived_publish_id, envelope_problem
from broker_ext.records import AdoptedMessage, StockSource
from broker_ext.scripts import SCRIPT_KEYS, ScriptCall, register, run_call

#: How long a fenced queue remembers which stock messages it took in (its ``adopted`` ledger).
DEFAULT_LEDGER_TTL_S = 7 * 24 * 3600
#: Entries per script call.
DEFAULT_BATCH = 200
#: Passes over one stock list: more only while stock workers pop from it at the same time.
MAX_LIST_PASSES = 5
#: Kombu's own remote-control exchanges (``celery.pidbox``, ``reply.celery.pidbox``): replies, not tasks.
PIDBOX_SUFFIX = ".pidbox"


class Left(StrEnum):
    """Why an entry stays in the stock keys."""

    MALFORMED = "not a Kombu message"
    TOO_LARGE = "larger than max_message_size"
    NOT_DUE = "unacked, within the visibility timeout: its stock worker may still run it"
    NO_AGE = "unacked, without a delivery time in unacked_index (stock never restores it)"
    UNROUTED = "unacked, routed to no queue (no binding of its exchange and routing key)"


@dataclass
class QueueMove:
    """What a move did (or, in a dry run, would do) for one queue."""

    queue: str
    moved: int = 0  # stored in the fenced queue
    delayed: int = 0  # of those, with an ETA still ahead: waiting in the fenced queue's delayed set
    from_unacked: int = 0  # of those, taken from the unacked hash (the others: from the queue lists)
    absorbed: int = 0  # taken out of the stock keys, not stored: moved before, or already in the queue
    gone: int = 0  # taken by a stock worker (popped, acked, restored) before the move could take it
    left: Counter = field(default_factory=Counter)  # Left reason -> entries staying in the stock keys

    def as_dict(self) -> dict:
        return {
            "queue": self.queue,
            "moved": self.moved,
            "delayed": self.delayed,
            "from_unacked": self.from_unacked,
            "absorbed": self.absorbed,
            "gone": self.gone,
            "left": {str(reason): count for reason, count in sorted(self.left.items())},
        }


@dataclass
class MoveReport:
    """A whole move: per queue, and what is known of the stock keys as a whole."""

    dry_run: bool
    same_server: bool
    visibility_timeout: float
    include_unacked: bool
    queues: dict[str, QueueMove] = field(default_factory=dict)
    journal: int = 0  # entries of an earlier, stopped run's journal finished first (dry run: waiting)
    unbound_lists: list[str] = field(default_factory=list)  # stock lists no binding names: not moved
    stray: Counter = field(default_factory=Counter)  # unacked entries of no queue: what they are -> count

    def of(self, queue: str) -> QueueMove:
        if queue not in self.queues:
            self.queues[queue] = QueueMove(queue)
        return self.queues[queue]

    @property
    def left(self) -> int:
        """Entries staying in the stock keys (those of unbound lists not counted: they were not read)."""
        return sum(sum(move.left.values()) for move in self.queues.values()) + sum(self.stray.values())

    def as_dict(self) -> dict:
        return {
            "dry_run": self.dry_run,
            "same_server": self.same_server,
            "visibility_timeout": self.visibility_timeout,
            "include_unacked": self.include_unacked,
            "journal": self.journal,
            "queues": [self.queues[name].as_dict() for name in sorted(self.queues)],
            "unbound_lists": self.unbound_lists,
            "stray": dict(sorted(self.stray.items())),
        }


@dataclass
class Candidate:
    """One stock entry to move: a list element or an unacked delivery tag, and where it goes."""

    source: str | bytes
    targets: list[tuple[str, AdoptedMessage]]  # (fenced queue, message), one per queue it is routed to
    from_unacked: bool


#: A stock entry (list element or delivery tag) and the journal fields (name, value) it goes to.
JournalEntry = tuple[str | bytes, list[tuple[str, str]]]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def publish_id_of(payload: dict, raw: bytes | str) -> str:
    """A stock message's publish id, derived from its Kombu delivery tag (a uuid per publish, kept by
    every stock redelivery), else from its bytes: the same stock message always gets the same one."""
    tag = (payload.get("properties") or {}).get("delivery_tag")
    if isinstance(tag, str) and tag:
        return derived_publish_id("stock", tag)
    return derived_publish_id("stock-bytes", _text(raw))


def _kombu_message(raw: bytes | str) -> dict | None:
    """The Kombu envelope a stock entry holds, or ``None`` when it is not one."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return None
    return payload if envelope_problem(payload) is None else None


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def redis_identity(client) -> tuple[str, int] | None:
    """(server run id, database) of a plain Redis client; ``None`` for a cluster client."""
    if not isinstance(client, redis.Redis):
        return None
    return str(client.info("server")["run_id"]), int(client.connection_pool.connection_kwargs.get("db") or 0)


class StockBroker:
    """The stock transport's keys in one Redis, named and routed as its own channel does.

    ``channel`` is a stock ``redis://`` Kombu channel made with the stock
    deployment's transport options; ``exchanges`` are the (name, type) pairs of
    the exchanges its producers declared (Celery's queues), so that an unacked
    entry is routed as stock's restore routes it (an undeclared exchange is
    direct, as on stock).
    """

    def __init__(self, channel, exchanges: Collection[tuple[str, str]] = ()) -> None:
        self.channel = channel
        channel.deadletter_queue = None  # An unroutable entry routes nowhere, not to Kombu's 'ae.undeliver'.
        for name, kind in exchanges:
            if name:
                channel.exchange_declare(exchange=name, type=kind)
        self.client = redis.Redis(connection_pool=channel.pool)  # Unprefixed: key names are built here.
        self.prefix = channel.global_keyprefix or ""
        self.sep = channel.sep
        self.unacked = StockSource(self.prefix + channel.unacked_key, self.prefix + channel.unacked_index_key)
        self.journal = adopting_key(self.prefix)
        self.visibility_timeout = float(channel.visibility_timeout)
        self.scripts = register(self.client)
        self._routes: dict[tuple[str, str], list[str]] = {}

    def list_source(self, key: str) -> StockSource:
        return replace(self.unacked, list=key)

    def queue_lists(self, queue: str) -> list[str]:
        """The lists of ``queue`` that exist, priority 0 (consumed first) to 9: every level a step can be."""
        keys = [self.prefix + queue] + [f"{self.prefix}{queue}{self.sep}{level}" for level in range(1, 10)]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        return [key for key, kind in zip(keys, pipe.execute(), strict=True) if _text(kind) == "list"]

    def _scan(self, pattern: str, kind: str) -> Iterator[str]:
        for key in self.client.scan_iter(match=_glob_escape(self.prefix) + pattern, count=1000, _type=kind):
            yield _text(key)[len(self.prefix) :]

    def bound_queues(self) -> set[str]:
        """The queues the binding tables name (every queue a stock producer or worker declared)."""
        table = self.channel.keyprefix_queue % ""
        queues: set[str] = set()
        for name in self._scan(_glob_escape(table) + "*", "set"):
            if name[len(table) :].endswith(PIDBOX_SUFFIX):
                continue
            for member in self.client.smembers(self.prefix + name):
                queues.add(_text(member).split(self.sep)[-1])
        queues.discard("")
        return queues

    def queue_of_list(self, name: str) -> str:
        """The queue a stock list belongs to (its name without a priority suffix)."""
        queue, sep, level = name.rpartition(self.sep)
        return queue if sep and level.isdigit() else name

    def lists(self) -> set[str]:
        """Names (without the key prefix) of every list in this Redis database."""
        return set(self._scan("*", "list"))

    def routes(self, exchange: str, routing_key: str) -> list[str]:
        """The queues stock's restore would push an unacked entry to."""
        if (exchange, routing_key) not in self._routes:
            found = self.channel._lookup(exchange, routing_key)
            self._routes[exchange, routing_key] = [q for q in dict.fromkeys(found) if q]
        return self._routes[exchange, routing_key]

    def list_batch(self, key: str, skip: int, count: int) -> list[bytes]:
        """Up to ``count`` elements before the last ``skip`` ones at the tail, oldest (next popped) first."""
        return list(reversed(self.client.lrange(key, -(skip + count), -(skip + 1))))

    def unacked_batches(self, count: int) -> Iterator[tuple[list[tuple[str, bytes]], list, int]]:
        """The unacked hash in batches: ((tag, entry) pairs, their unacked_index scores, server time ms)."""
        seen: set[str] = set()
        batch: list[tuple[str, bytes]] = []
        for tag, entry in self.client.hscan_iter(self.unacked.unacked, count=count):
            tag = _text(tag)
            if tag in seen:
                continue  # HSCAN may return an entry twice.
            seen.add(tag)
            batch.append((tag, entry))
            if len(batch) >= count:
                yield self._aged(batch)
                batch = []
        if batch:
            yield self._aged(batch)

    def _aged(self, batch: list[tuple[str, bytes]]) -> tuple[list[tuple[str, bytes]], list, int]:
        pipe = self.client.pipeline(transaction=False)
        pipe.zmscore(self.unacked.unacked_index, [tag for tag, _ in batch])
        pipe.time()
        scores, (seconds, micros) = pipe.execute()
        return batch, scores, int(seconds) * 1000 + int(micros) // 1000

    def take(self, source: StockSource, entries: Sequence[JournalEntry], max_age_ms: int) -> list[Reply]:
        """``adopt_take``: each (entry, [(journal field, value)]) into the journal; one reply per entry."""
        args: list = [source.where, max_age_ms]
        for entry, fields in entries:
            args += [entry, len(fields)]
            for name, value in fields:
                args += [name, value]
        keys = {"journal": self.journal, "unacked": source.unacked, "unacked_index": source.unacked_index}
        keys["list"] = source.list_key
        call = ScriptCall(
            "stock", self.scripts.adopt_take, [keys[role] for role in SCRIPT_KEYS["adopt_take"]], args, list
        )
        return [Reply(r) for r in run_call(self.client, call)]

    def journal_batches(self, count: int) -> Iterator[list[tuple[str, bytes]]]:
        batch: list[tuple[str, bytes]] = []
        for name, value in self.client.hscan_iter(self.journal, count=count):
            batch.append((_text(name), value))
            if len(batch) >= count:
                yield batch
                batch = []
        if batch:
            yield batch


class Mover:
    """Moves (or, dry, counts) what a stock deployment holds into the fenced queues of ``fenced``.

    ``fenced`` is a fenced channel (its queues' options and key prefix, and the
    publish path's reading of a message: id, priority, ETA, size limit).
    ``queues`` limits the move to those queues (``None``: every queue found).
    ``progress`` is called with the number of stock entries each step dealt with.
    """

    def __init__(
        self,
        stock: StockBroker,
        fenced,
        *,
        queues: Collection[str] | None = None,
        include_unacked: bool = False,
        ledger_ttl_s: float = DEFAULT_LEDGER_TTL_S,
        batch: int = DEFAULT_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.stock = stock
        self.fenced = fenced
        self.only = set(queues) if queues else None
        self.include_unacked = include_unacked
        self.ledger_ttl_ms = int(ledger_ttl_s * 1000)
        self.batch = batch
        self.progress = progress or (lambda n: None)
        identity = redis_identity(stock.client)
        self.same_server = identity is not None and identity == redis_identity(fenced.fenced_client)
        self.max_age_ms = -1 if include_unacked else int(stock.visibility_timeout * 1000)

    # -- what there is -----------------------------------------------------------------

    def queue_names(self) -> tuple[list[str], list[str]]:
        """The queues to move (asked for, or found), and the stock lists no binding names (not moved)."""
        lists = self.stock.lists()
        if self.only is not None:
            return sorted(self.only), []
        bound = self.stock.bound_queues()
        unbound = sorted(name for name in lists if self.stock.queue_of_list(name) not in bound)
        return sorted(bound), unbound

    def total(self, queues: Sequence[str]) -> int:
        """Stock entries a move looks at: the lists of ``queues``, the unacked hash and the journal."""
        pipe = self.stock.client.pipeline(transaction=False)
        for queue in queues:
            for key in self.stock.queue_lists(queue):
                pipe.llen(key)
        pipe.hlen(self.stock.unacked.unacked)
        pipe.hlen(self.stock.journal)
        return sum(int(n) for n in pipe.execute())

    # -- reading an entry ----------------------------------------------------------------

    def _message(self, payload: dict, raw: bytes | str, *, stored: str | bytes) -> AdoptedMessage:
        """What a fenced queue stores of a stock message, ``stored`` as its payload (or MessageTooLarge)."""
        outgoing = self.fenced.outgoing(payload)
        publish_id = publish_id_of(payload, raw)
        return AdoptedMessage(replace(outgoing, payload=stored, dedup_key=None, publish_id=publish_id))

    def _list_candidate(self, queue: str, raw: bytes, left: Counter) -> Candidate | None:
        payload = _kombu_message(raw)
        if payload is None:
            left[Left.MALFORMED] += 1
            return None
        try:
            message = self._message(payload, raw, stored="")
        except MessageTooLarge:
            left[Left.TOO_LARGE] += 1
            return None
        return Candidate(raw, [(queue, message)], from_unacked=False)

    def _unacked_candidate(self, report: MoveReport, tag: str, entry: bytes, score, now_ms: int):
        """The candidate of an unacked entry, or ``None`` when it stays (counted in ``report``)."""
        payload, routes = self._unacked_routes(report, entry)
        if payload is None or not routes:
            return None
        reason = self._not_yet(score, now_ms)
        if reason is not None:
            for queue in routes:
                report.of(queue).left[reason] += 1
            return None
        # As stock's restore_visible puts it back: marked redelivered.
        if isinstance(payload.get("headers"), dict):
            payload["headers"]["redelivered"] = True
        payload["properties"].setdefault("delivery_info", {})["redelivered"] = True
        try:
            message = self._message(payload, entry, stored=json.dumps(payload))
        except MessageTooLarge:
            for queue in routes:
                report.of(queue).left[Left.TOO_LARGE] += 1
            return None
        return Candidate(tag, [(queue, message) for queue in routes], from_unacked=True)

    def _unacked_routes(self, report: MoveReport, entry: bytes) -> tuple[dict | None, list[str]]:
        """An unacked entry's message and the queues (of those asked for) stock would restore it to."""
        try:
            payload, exchange, routing_key = json.loads(entry)
        except (ValueError, TypeError):
            payload = exchange = routing_key = None
        if not isinstance(payload, dict) or envelope_problem(payload) is not None:
            report.stray[f"{Left.MALFORMED} (unacked)"] += 1
            return None, []
        routes = self.stock.routes(exchange or "", routing_key or "")
        if not routes:
            report.stray[f"{Left.UNROUTED}: exchange {exchange!r}, routing key {routing_key!r}"] += 1
        return payload, [queue for queue in routes if self.only is None or queue in self.only]

    def _not_yet(self, score, now_ms: int) -> Left | None:
        """Why an unacked entry delivered at ``score`` (seconds) may not move yet, or ``None``."""
        if self.max_age_ms < 0:
            return None
        if score is None:
            return Left.NO_AGE
        return Left.NOT_DUE if float(score) * 1000 > now_ms - self.max_age_ms else None

    # -- the move ------------------------------------------------------------------------

    def survey(self) -> MoveReport:
        """A dry run: what a move would do now, per queue, and what it would leave and why."""
        return self._walk(dry_run=True)

    def run(self) -> MoveReport:
        """Move: an earlier run's journal first, then the unacked entries, then the queue lists."""
        return self._walk(dry_run=False)

    def _walk(self, *, dry_run: bool) -> MoveReport:
        report = MoveReport(dry_run, self.same_server, self.stock.visibility_timeout, self.include_unacked)
        queues, report.unbound_lists = self.queue_names()
        for queue in queues:
            report.of(queue)
        self._journal(report, dry_run)
        self._unacked(report, dry_run)
        for queue in queues:
            for key in self.stock.queue_lists(queue):
                self._list(report, queue, key, dry_run)
        return report

    def _journal(self, report: MoveReport, dry_run: bool) -> None:
        """Store what an earlier run took into the journal and then stopped: its messages are out of stock."""
        for batch in self.stock.journal_batches(self.batch):
            by_queue: dict[str, list[tuple[str, AdoptedMessage]]] = {}
            for name, value in batch:
                queue, publish_id = json.loads(name)
                message = self.fenced.outgoing(json.loads(value))
                stored = replace(message, payload=value, dedup_key=None, publish_id=publish_id)
                adopted = AdoptedMessage(stored)
                by_queue.setdefault(queue, []).append((name, adopted))
            report.journal += len(batch)
            if not dry_run:
                for queue, entries in by_queue.items():
                    self._store(report.of(queue), queue, entries, from_unacked=False)
            self.progress(len(batch))

    def _store(self, move: QueueMove, queue: str, entries: list[tuple[str, AdoptedMessage]], *, from_unacked):
        """``adopt`` journal entries into ``queue``, then delete their journal fields."""
        # Into shard 0 of a sharded queue: one ledger of stock publish ids, and consumers claim there.
        target = self.fenced.fenced_queue(queue).shards[0]
        replies = target.adopt([m for _, m in entries], self.ledger_ttl_ms)
        for (_, adopted), reply in zip(entries, replies, strict=True):
            self._count(move, adopted, reply, from_unacked)
        self.stock.client.hdel(self.stock.journal, *[name for name, _ in entries])

    def _count(self, move: QueueMove, adopted: AdoptedMessage, reply: Reply, from_unacked: bool) -> None:
        if reply is Reply.OK:
            move.moved += 1
            move.delayed += adopted.message.delay_ms > 0
            move.from_unacked += from_unacked
        elif reply in (Reply.ADOPTED, Reply.DUPLICATE):
            move.absorbed += 1
        elif reply is Reply.NOT_FOUND:
            move.gone += 1
        elif reply is Reply.NOT_DUE:
            move.left[Left.NOT_DUE] += 1

    def _unacked(self, report: MoveReport, dry_run: bool) -> None:
        for batch, scores, now_ms in self.stock.unacked_batches(self.batch):
            candidates = []
            for (tag, entry), score in zip(batch, scores, strict=True):
                candidate = self._unacked_candidate(report, tag, entry, score, now_ms)
                if candidate is not None:
                    candidates.append(candidate)
            self._move(report, self.stock.unacked, candidates, dry_run)
            self.progress(len(batch))

    def _list(self, report: MoveReport, queue: str, key: str, dry_run: bool) -> None:
        """Move one stock list, oldest first; again while stock workers popping from it shift it meanwhile."""
        move = report.of(queue)
        for attempt in range(1 if dry_run else MAX_LIST_PASSES):
            left = Counter()
            if not self._list_pass(report, queue, key, left, dry_run, first=attempt == 0) or dry_run:
                break
        move.left.update(left)  # What the last pass found staying.

    def _list_pass(self, report: MoveReport, queue: str, key: str, left: Counter, dry_run: bool, *, first):
        """One pass over a stock list from its tail; returns how many entries it took out of it."""
        move = report.of(queue)
        taken_before, skip = move.moved + move.absorbed, 0
        while batch := self.stock.list_batch(key, skip, self.batch):
            candidates = [c for raw in batch if (c := self._list_candidate(queue, raw, left)) is not None]
            # What stays is at the tail, before the next batch; what moved is gone (a dry run moves nothing).
            skip += len(batch) if dry_run else len(batch) - len(candidates)
            self._move(report, self.stock.list_source(key), candidates, dry_run)
            if first:
                self.progress(len(batch))
        return move.moved + move.absorbed - taken_before

    def _move(self, report: MoveReport, source: StockSource, candidates: list[Candidate], dry_run: bool):
        if dry_run:
            for candidate in candidates:
                for queue, adopted in candidate.targets:
                    self._count(report.of(queue), adopted, Reply.OK, candidate.from_unacked)
            return
        if self.same_server:
            single = [c for c in candidates if len(c.targets) == 1]
            self._move_locally(report, source, single)
            candidates = [c for c in candidates if len(c.targets) > 1]
        if candidates:
            self._move_through_journal(report, source, candidates)

    def _move_locally(self, report: MoveReport, source: StockSource, candidates: list[Candidate]) -> None:
        """One ``adopt_local`` call per queue: each entry taken and stored in one atomic step."""
        by_queue: dict[str, list[tuple[Candidate, AdoptedMessage]]] = {}
        for candidate in candidates:
            ((queue, adopted),) = candidate.targets
            by_queue.setdefault(queue, []).append((candidate, replace(adopted, source=candidate.source)))
        for queue, entries in by_queue.items():
            target = self.fenced.fenced_queue(queue).shards[0]  # shard 0 of a sharded queue, as _store
            replies = target.adopt_local(
                source,
                [adopted for _, adopted in entries],
                max_age_ms=self.max_age_ms,
                ledger_ttl_ms=self.ledger_ttl_ms,
            )
            for (candidate, adopted), reply in zip(entries, replies, strict=True):
                self._count(report.of(queue), adopted, reply, candidate.from_unacked)

    def _move_through_journal(self, report: MoveReport, source: StockSource, candidates: list[Candidate]):
        """Take into the stock server's journal, store on the fenced one, then clear the journal."""
        entries = []
        for candidate in candidates:
            fields = [
                (json.dumps([queue, adopted.publish_id]), _text(adopted.message.payload))
                for queue, adopted in candidate.targets
            ]
            entries.append((candidate.source, fields))
        replies = self.stock.take(source, entries, self.max_age_ms)
        by_queue: dict[str, list[tuple[str, AdoptedMessage]]] = {}
        for candidate, (_, fields), reply in zip(candidates, entries, replies, strict=True):
            for (queue, adopted), (name, _) in zip(candidate.targets, fields, strict=True):
                if reply is Reply.OK:
                    payload = adopted.message.payload or candidate.source
                    stored = replace(adopted, message=replace(adopted.message, payload=payload))
                    by_queue.setdefault(queue, []).append((name, stored))
                else:
                    self._count(report.of(queue), adopted, reply, candidate.from_unacked)
        for queue, stored in by_queue.items():
            self._store(report.of(queue), queue, stored, from_unacked=source.where == "unacked")
