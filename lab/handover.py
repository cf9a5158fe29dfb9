"""What the demo leaves behind for the admin, and starting it again: ``manage.py demo --serve``.

The demo's database stays where it is (``var/demo/db.sqlite3`` under
``bin/demo``). Its fenced run's Redis kept its data in the run directory
(AOF, ``appendfsync always``; the server was shut down cleanly), so the dead
letters, the delivery records and the queue counters the demo reported are
still on disk. The demo writes ``handover.json`` in ``QUEUEAPP_VAR_DIR``
naming that directory; :func:`start_redis` starts a ``redis-server`` on it
again (on a free port, never 6379), and :func:`admin_env` gives the
environment variables ``settings/base.py`` reads to point the admin at it.
The stock run's Redis is not served: the admin reads fenced:// queues only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lab.errors import LabError
from lab.redis_servers import RedisServer

HANDOVER = "handover.json"
#: The database number of the broker's keys, and the one of the cache, as the demo's workers had them.
BROKER_DB = 0
CACHE_DB = 1


@dataclass(frozen=True)
class Handover:
    """The last demo's result on disk: its run ids and the directory of its fenced run's Redis."""

    run_id: str
    runs: dict[str, str]
    redis_dir: Path

    def as_dict(self, base: Path) -> dict:
        return {"run_id": self.run_id, "runs": dict(self.runs), "redis_dir": relative(self.redis_dir, base)}


def relative(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` when it is inside it, else as it is."""
    try:
        return str(Path(path).resolve().relative_to(Path(base).resolve()))
    except ValueError:
        return str(path)


def write(var_dir: Path, handover: Handover) -> Path:
    """Record ``handover`` in ``var_dir/handover.json`` (paths relative to ``var_dir``)."""
    path = Path(var_dir) / HANDOVER
    path.write_text(json.dumps(handover.as_dict(Path(var_dir)), indent=2) + "\n")
    return path


def read(var_dir: Path) -> Handover:
    """The last demo's handover in ``var_dir``; raises :class:`LabError` saying what is missing."""
    path = Path(var_dir) / HANDOVER
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LabError(f"no demo result in {var_dir} ({HANDOVER} is missing): run bin/demo first") from None
    except ValueError as exc:
        raise LabError(f"{path} is not valid JSON ({exc}): run bin/demo again") from None
    # Absolute: redis-server changes into --dir before it opens its log file there.
    redis_dir = (Path(var_dir) / data["redis_dir"]).resolve()
    if not (redis_dir / "appendonlydir").is_dir():
        raise LabError(f"the demo's Redis data is gone from {redis_dir}: run bin/demo again")
    return Handover(run_id=data["run_id"], runs=dict(data.get("runs", {})), redis_dir=redis_dir)


def redis_server(handover: Handover, port: int = 0) -> RedisServer:
    """A (not yet started) ``redis-server`` on the demo's data; AOF stays on, so changes are kept."""
    return RedisServer(port=port, appendonly=True, directory=handover.redis_dir)


def start_redis(handover: Handover, port: int = 0, timeout: float = 30.0) -> RedisServer:
    """Start the demo's Redis again on its data (``port`` 0: a free one); stop it with ``.stop()``."""
    return redis_server(handover, port).start(timeout)


def admin_env(server: RedisServer, var_dir: Path) -> dict[str, str]:
    """The environment that points the project's settings at the demo's database and Redis."""
    host = f"127.0.0.1:{server.port}"
    return {
        "QUEUEAPP_VAR_DIR": str(var_dir),
        "REDIS_URL": f"redis://{host}/{CACHE_DB}",
        "BROKER_URL": f"fenced://{host}/{BROKER_DB}",
    }
