"""``--profile DIR``: py-spy profiles of extra runs, summarised into where the time of a message goes.

Profiled runs are extra repeats whose figures are thrown away (sampling costs
CPU on a 2-core machine), so profiling never distorts the table. py-spy
samples the bench process itself (Kombu level) or a worker and its pool
children (Celery level), idle frames included: time blocked on a socket is a
round trip to Redis, which is exactly what the transport should save.

Each profile gives ``<name>.txt`` (py-spy's collapsed stacks) and a summary:
the share of main-thread samples per category (by the innermost frame), the
share of samples whose stack passes through a few markers (client
construction, Lua script calls, JSON, transactions), and the top functions.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from lab.processes import REPO

SAMPLE_RATE = 500
ATTACH_SECONDS = 0.5
FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>.*?)(?::\d+)?\)$")

#: Innermost-frame categories, first match wins: (name, function names, path fragments).
LEAF_CATEGORIES: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    (
        "waiting on a Redis reply (socket read)",
        frozenset(
            {"read_from_socket", "_read_from_socket", "recv", "recv_into", "readline", "_socket_can_read"}
        ),
        (),
    ),
    ("waiting in the event loop (poll/select)", frozenset({"poll", "select", "_poll", "_select"}), ()),
    ("sending to Redis (socket write)", frozenset({"sendall", "send_packed_command"}), ()),
    ("JSON encode/decode", frozenset(), ("json/", "kombu/utils/json.py")),
    ("redis-py (commands, pipelines, pool)", frozenset(), ("redis/",)),
    ("broker_ext (fenced transport)", frozenset(), ("broker_ext/",)),
    ("Kombu", frozenset(), ("kombu/",)),
    ("Celery and billiard", frozenset(), ("celery/", "billiard/", "vine/")),
    ("queueapp (exactly-once layer)", frozenset(), ("queueapp/",)),
    ("Django (ORM, database driver)", frozenset(), ("django/", "psycopg/", "sqlite3/")),
    ("Dramatiq", frozenset(), ("dramatiq/",)),
    ("the bench harness", frozenset(), ("lab/bench/",)),
)

#: Packages whose functions are worth listing by inclusive time (not the harness, click, runpy).
LIBRARIES = ("redis/", "kombu/", "celery/", "billiard/", "broker_ext/", "queueapp/", "json/", "django/db/")

#: Stack markers: share of samples whose stack passes through any of these (function, path fragment).
MARKERS: dict[str, tuple[tuple[str, str], ...]] = {
    "redis client construction (Redis(), pools)": (
        ("__init__", "redis/client.py"),
        ("__init__", "connection.py"),
    ),
    "connection pool get/release": (("get_connection", "redis/"), ("release", "redis/connection.py")),
    "Lua script calls (EVALSHA)": (
        ("__call__", "redis/commands/core.py"),
        ("run_calls", ""),
        ("run_call", ""),
    ),
    "MULTI/EXEC transactions": (("transaction", "redis/client.py"), ("multi", "redis/client.py")),
    "pipelines": (("execute", "redis/client.py"),),
    "JSON encode/decode": (("", "json/"), ("", "kombu/utils/json.py")),
    "Kombu message construction": (("__init__", "kombu/message.py"), ("_inplace_augment_message", "kombu/")),
}


def available() -> bool:
    return shutil.which("py-spy") is not None


@contextlib.contextmanager
def py_spy(profile_dir: Path | None, pid: int, name: str) -> Iterator[Path | None]:
    """Sample ``pid`` (and its children) while the block runs; yields the output path (``None``: off)."""
    if profile_dir is None or not available():
        yield None
        return
    profile_dir.mkdir(parents=True, exist_ok=True)
    output = profile_dir / f"{name}.txt"
    sampler = subprocess.Popen(
        [
            *("py-spy", "record", "--pid", str(pid), "--format", "raw", "--output", str(output)),
            *("--rate", str(SAMPLE_RATE), "--subprocesses", "--idle", "--nonblocking"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(ATTACH_SECONDS)
    try:
        yield output
    finally:
        if sampler.poll() is None:
            sampler.send_signal(signal.SIGINT)
            try:
                sampler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait(timeout=10)


def parse_frame(frame: str) -> tuple[str, str]:
    match = FRAME.match(frame.strip())
    return (match["function"], match["file"]) if match else (frame.strip(), "")


def main_thread_stacks(text: str) -> Counter:
    """Collapsed stacks of the threads doing the work: a thread started by ``threading`` is left out."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = tuple(parse_frame(frame) for frame in stack.split(";"))
        if any(
            _method(function) == "_bootstrap" and file.endswith("threading.py")
            for function, file in frames[:3]
        ):
            continue
        if any(function == "py_spy" and file.endswith("profiling.py") for function, file in frames):
            continue  # The harness waiting for py-spy to attach or to write its output.
        stacks[frames] += int(count)
    return stacks


def _in(file: str, fragment: str) -> bool:
    """Whether ``file`` (as py-spy names it: from its package folder on) lies under ``fragment``."""
    return file.startswith(fragment) or f"/{fragment}" in file


def _method(function: str) -> str:
    """py-spy names methods ``Class.method``; the rules match the method's own name."""
    return function.rsplit(".", 1)[-1]


def leaf_category(function: str, file: str) -> str:
    for name, functions, paths in LEAF_CATEGORIES:
        if _method(function) in functions or any(_in(file, fragment) for fragment in paths):
            return name
    return "other (Python stdlib, interpreter)"


def summarize(path: Path, seconds_per_message: float | None = None, top: int = 12) -> dict:
    """Shares of the samples per category, per marker, and per function; µs per message when known."""
    stacks = main_thread_stacks(path.read_text(errors="replace")) if path.exists() else Counter()
    total = sum(stacks.values())
    if not total:
        return {"samples": 0}
    categories: Counter = Counter()
    markers: Counter = Counter()
    leaves: Counter = Counter()
    inclusive: Counter = Counter()
    for frames, count in stacks.items():
        function, file = frames[-1]
        categories[leaf_category(function, file)] += count
        leaves[f"{function} ({_short(file)})"] += count
        for seen in {f"{f} ({_short(p)})" for f, p in frames if any(_in(p, pkg) for pkg in LIBRARIES)}:
            inclusive[seen] += count
        for marker, patterns in MARKERS.items():
            if any(
                (not name or _method(function) == name) and (not fragment or _in(path, fragment))
                for function, path in frames
                for name, fragment in patterns
            ):
                markers[marker] += count

    def shares(counter: Counter, limit: int | None = None) -> list[dict]:
        rows = []
        for name, count in counter.most_common(limit):
            share = count / total
            row = {"name": name, "share": round(share, 4)}
            if seconds_per_message:
                row["us_per_message"] = round(share * seconds_per_message * 1e6, 1)
            rows.append(row)
        return rows

    return {
        "samples": total,
        "us_per_message": round(seconds_per_message * 1e6, 1) if seconds_per_message else None,
        "categories": shares(categories),
        "markers": shares(markers),
        "top_self": shares(leaves, top),
        # The event loop's outer frames are on every stack; the functions below them tell more.
        "top_inclusive": shares(Counter({k: v for k, v in inclusive.items() if v < 0.9 * total}), top),
    }


def _short(file: str) -> str:
    """A path short enough for a report: from the package folder on."""
    file = file.removeprefix(f"{REPO}/")
    return file.split("site-packages/", 1)[-1]
