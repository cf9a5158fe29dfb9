"""Hypothesis strategies for the messages a producer can send: Celery protocol 2 and Kombu envelopes.

An example starts from the exact message Celery would publish for
``lab.fenced_effect(run, label)`` (an ``@exactly_once`` task whose effect is
one row) and mutates it: headers replaced by any JSON value or removed,
properties changed, the body replaced by something that is not a task, or its
id made to collide with an earlier example's. Most examples change one or two
things, so that each fate can be traced to its cause; the label in the
arguments tells the effect rows apart.

:func:`draw_specs` runs the strategies through Hypothesis itself (seeded,
no example database), so its boundary values and size distribution apply,
and returns plain data the harness publishes.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from broker_ext.messages import PUBLISH_ID
from lab.task_messages import task_envelope

#: The exactly-once task every example is (or pretends to be) a call of.
TASK = "lab.fenced_effect"
#: Headers of a protocol 2 task message that the fuzzer mutates or removes.
HEADERS = (
    "id",
    "task",
    "retries",
    "eta",
    "expires",
    "timelimit",
    "argsrepr",
    "kwargsrepr",
    "root_id",
    "parent_id",
    "group",
    "shadow",
    "origin",
    "replaced_task_nesting",
)
#: Message properties (and envelope fields) the fuzzer changes.
PROPERTIES = ("priority", "delivery_tag", "correlation_id", "reply_to", "body_encoding")
ENVELOPE_FIELDS = ("content-type", "content-encoding")
#: Bodies that are not a task call.
BODY_KINDS = ("not-json", "json-not-a-task", "huge", "deep", "not-utf8", "args-not-a-list", "no-body")
#: Payload size of a ``huge`` body: above the workers' ``max_message_size`` (set by the harness).
HUGE = 300_000


@dataclass(frozen=True)
class Mutation:
    """One change to the valid message: ``target`` is ``header``, ``property``, ``envelope`` or ``body``."""

    target: str
    name: str
    value: object = None
    removed: bool = False

    def describe(self) -> str:
        if self.target == "body":
            return f"body:{self.name}"
        if self.removed:
            return f"{self.target}:{self.name}=missing"
        return f"{self.target}:{self.name}={_kind_of(self.value)}"


@dataclass(frozen=True)
class Spec:
    """What Hypothesis drew for one example, before the batch gives it its identity."""

    mutations: tuple[Mutation, ...] = ()
    collide: str = ""  # "", "same-message" (resent publish) or "next-retry" (same task id, next attempt)
    raw_priority: object = None  # Published as the script argument directly (a producer on FencedQueue)


@dataclass
class Example:
    """One message to publish: its identity, the payload as stored, and what was done to it."""

    index: int
    label: str
    task_id: object
    payload: bytes
    envelope: dict | None
    spec: Spec
    message_id: str = ""
    kinds: tuple[str, ...] = field(default_factory=tuple)

    @property
    def kind(self) -> str:
        """The example's input class, for the report: ``valid`` or its mutations joined."""
        return ",".join(self.kinds) or "valid"


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float" if value == value and abs(value) != float("inf") else "nan/inf"
    if isinstance(value, str):
        return "empty-str" if not value else "str"
    if isinstance(value, list):
        return "list"
    return "object"


# -- strategies ---------------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["", "-0", "0", "1", "abc", "2026-01-01T00:00:00", "9999-12-31T23:59:59+00:00", "null"])
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
#: Values a header is likely to be given by a confused producer, plus anything JSON can hold.
header_values = st.one_of(
    json_values,
    st.lists(st.one_of(st.none(), st.integers(-5, 5), st.floats(-1, 10), st.text(max_size=3)), max_size=3),
    st.integers(min_value=-5, max_value=5),
)


#: What a confused producer tends to put in each header, tried besides any JSON value.
LIKELY: dict[str, list] = {
    "id": ["", 7, None, "x" * 300, ["a"], "with space", "é"],
    "retries": ["abc", [1], -1, 1.5, "1", None, 2**64, True],
    "eta": [
        "not a date",
        1700000000,
        "2026-01-01T00:00:00",
        "2020-01-01T00:00:00+00:00",
        "9999-12-31T23:59:59",
    ],
    "expires": ["soon", 60, "2020-01-01T00:00:00+00:00", "2099-01-01T00:00:00", -1],
    "timelimit": [["a", "b"], [1, 2, 3], [None, None], [-1, 5], [1e300, None], [float("nan"), 1], 5, "1,2"],
    # Not another registered task's name: that is a valid call of that task, with its own rules.
    "task": ["", "lab.nope", ["lab.fenced_effect"], "x" * 2000, "lab.fenced_effect "],
    "argsrepr": [None, 5, ["a"]],
    "root_id": [None, 5, [], "x" * 300],
    "group": [5, [], "g"],
    "shadow": [5, [], "", "other.name"],
    "replaced_task_nesting": ["1", -1, None, 2**70],
}


def header_mutations() -> st.SearchStrategy[Mutation]:
    def for_header(name: str) -> st.SearchStrategy[Mutation]:
        likely = st.sampled_from(LIKELY[name]) if name in LIKELY else header_values
        value = st.one_of(likely, likely, header_values)
        return st.builds(Mutation, st.just("header"), st.just(name), value, st.booleans())

    return st.sampled_from(HEADERS).flatmap(for_header)


def property_mutations() -> st.SearchStrategy[Mutation]:
    priority = st.one_of(
        st.integers(-3, 12), st.sampled_from(["-0", "5", "x", -0.0, 1.5, float("nan")]), json_values
    )
    return st.one_of(
        st.builds(Mutation, st.just("property"), st.just("priority"), priority, st.booleans()),
        st.builds(Mutation, st.just("property"), st.sampled_from(PROPERTIES[1:]), json_values, st.booleans()),
        st.builds(
            Mutation,
            st.just("envelope"),
            st.sampled_from(ENVELOPE_FIELDS),
            st.one_of(
                st.sampled_from(["application/x-python-serialize", "text/plain", "binary"]), json_values
            ),
            st.booleans(),
        ),
    )


def body_mutations() -> st.SearchStrategy[Mutation]:
    return st.builds(Mutation, target=st.just("body"), name=st.sampled_from(BODY_KINDS))


def specs() -> st.SearchStrategy[Spec]:
    """One example: valid (about a fifth), or one to three changes, sometimes a colliding id."""
    changes = st.lists(
        st.one_of(header_mutations(), header_mutations(), property_mutations(), body_mutations()),
        min_size=0,
        max_size=3,
    )
    return st.builds(
        Spec,
        mutations=changes.map(tuple),
        collide=st.sampled_from(["", "", "", "", "", "", "same-message", "next-retry"]),
        raw_priority=st.one_of(
            st.none(), st.none(), st.none(), st.sampled_from(["-0", -0.0, 1.5, "07", 10, -1])
        ),
    )


def draw_specs(count: int, seed: int) -> list[Spec]:
    """``count`` specs drawn by Hypothesis with ``seed`` (the same seed gives the same specs)."""
    drawn: list[Spec] = []

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(specs())
    def collect(spec: Spec) -> None:
        drawn.append(spec)

    collect()
    return drawn[:count]


# -- building the messages ----------------------------------------------------------------------------------


def valid_envelope(app, *, run: str, label: str, task_id: str, queue: str) -> dict:
    """The message Celery publishes for ``lab.fenced_effect(run, label)``, as Kombu stores it."""
    # The publish id is what publish_id_of() would set; a resend reuses it.
    return task_envelope(
        app,
        task_name=TASK,
        task_id=task_id,
        args=[run, label],
        queue=queue,
        properties={PUBLISH_ID: uuid.uuid4().hex},
    )


def _body(kind: str, run: str, label: str) -> bytes | object:
    """The encoded inner body of a body mutation, or the whole payload (bytes) for ``not-json``."""
    if kind == "json-not-a-task":
        return json.dumps({"run": run, "label": label}).encode()
    if kind == "huge":
        return json.dumps([[run, label, "x" * HUGE], {}, {}]).encode()
    if kind == "deep":
        return ("[" * 5000 + "]" * 5000).encode()
    if kind == "not-utf8":
        return b"\xff\xfe[\x80" + label.encode()
    if kind == "args-not-a-list":
        return json.dumps([{"run": run}, {}, {}]).encode()
    return b""


def _collide(envelope: dict, collide: str, before: Example) -> None:
    """``next-retry``: the next attempt of the same task; ``same-message``: a resend of the same publish
    (a retry after a lost reply), with its message id and publish id."""
    if collide == "next-retry":
        envelope["headers"]["retries"] = 1
    elif before.envelope is not None:
        publish_id = (before.envelope.get("properties") or {}).get(PUBLISH_ID)
        if publish_id:
            envelope["properties"][PUBLISH_ID] = publish_id


def build(app, spec: Spec, *, index: int, run: str, queue: str, earlier: list[Example]) -> Example:
    """The example ``spec`` describes, numbered ``index`` in its run; collisions reuse an earlier id."""
    label = f"{run}-{index}"
    task_id = str(uuid.uuid4())
    collide = spec.collide if earlier else ""
    if collide:
        task_id = earlier[-1].task_id if isinstance(earlier[-1].task_id, str) else task_id
    envelope = valid_envelope(app, run=run, label=label, task_id=task_id, queue=queue)
    kinds: list[str] = [f"collide:{collide}"] if collide else []
    if collide:
        _collide(envelope, collide, earlier[-1])
    payload: bytes | None = None
    for mutation in spec.mutations:
        kinds.append(mutation.describe())
        if mutation.target == "body":
            if mutation.name == "not-json":
                payload = b'{"body": "' + label.encode() + b'", this is not JSON'
            elif mutation.name == "no-body":
                envelope.pop("body", None)
            else:
                envelope["body"] = base64.b64encode(_body(mutation.name, run, label)).decode()
            continue
        where = {"header": envelope["headers"], "property": envelope["properties"], "envelope": envelope}[
            mutation.target
        ]
        if mutation.removed:
            where.pop(mutation.name, None)
        else:
            where[mutation.name] = mutation.value
    if spec.raw_priority is not None:
        kinds.append(f"raw-priority={spec.raw_priority!r}")
    not_json = payload is not None  # The whole payload was replaced: there is no envelope to publish.
    if payload is None:
        payload = json.dumps(envelope).encode()
    return Example(
        index=index,
        label=label,
        task_id=envelope["headers"].get("id") if isinstance(envelope.get("headers"), dict) else None,
        payload=payload,
        envelope=None if not_json else envelope,
        spec=spec,
        kinds=tuple(kinds),
    )
