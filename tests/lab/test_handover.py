"""The demo's handover: its Redis data and database, opened again by ``bin/admin`` (``demo --serve``).

A full demo takes more than a minute, so the test makes a small result of the
same shape by hand: a fenced queue with a dead-lettered message in a Redis
with AOF under ``<var>/faultlab/<run>/redis-fenced``, an effect row committed
twice in the SQLite database of ``<var>``, and ``handover.json``. Then it runs
the handover path as a user would, in real processes: ``manage.py demo --run
createsuperuser --noinput``, then ``manage.py demo --serve`` (the demo's Redis
and runserver), logs in over HTTP and reads the admin pages.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab import handover
from lab.processes import REPO, ManagedProcess, wait_for
from lab.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.slow

RUN = "fl-20260101-000000-s0"


def manage(var_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=environment(var_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def environment(var_dir: Path) -> dict[str, str]:
    """This test's demo directory, SQLite (never the PostgreSQL pass's DATABASE_URL), a login from env."""
    env = {name: value for name, value in os.environ.items() if name not in ("DATABASE_URL", "REDIS_URL")}
    return {
        **env,
        # Relative, as the closing lines print it: the demo's Redis must still find its directory.
        "QUEUEAPP_VAR_DIR": os.path.relpath(var_dir, REPO),
        "DJANGO_SUPERUSER_USERNAME": "operator",
        "DJANGO_SUPERUSER_EMAIL": "operator@example.com",
        "DJANGO_SUPERUSER_PASSWORD": "demo-password",
    }


@pytest.fixture
def demo_result(tmp_path) -> Path:
    """A demo result on disk: a dead letter in its fenced Redis data, a double effect in its database."""
    var_dir = tmp_path / "demo"
    redis_dir = var_dir / "faultlab" / RUN / "redis-fenced"
    redis_dir.mkdir(parents=True)
    server = RedisServer(appendonly=True, directory=redis_dir).start()
    try:
        queue = FencedQueue(server.client(), "faultlab.q1")
        queue.publish([OutgoingMessage(f"{RUN}-fenced-bad-json-1.0", "{not json")])
        queue.force_dead_letter([f"{RUN}-fenced-bad-json-1.0"], "malformed body")
    finally:
        server.stop()  # Not cleanup(): that would remove the data this test hands over.
    handover.write(
        var_dir, handover.Handover(RUN, {"fenced": f"{RUN}-fenced", "stock": f"{RUN}-stock"}, redis_dir)
    )
    assert manage(var_dir, "migrate", "--skip-checks", "-v0").returncode == 0
    code = (
        "from lab.models import Effect; "
        f"[Effect.objects.create(run='{RUN}-stock', label='t00001') for _ in range(2)]; "
        f"Effect.objects.create(run='{RUN}-fenced', label='t00001')"
    )
    assert manage(var_dir, "shell", "-c", code).returncode == 0
    return var_dir


class Browser:
    """A logged-in admin session over HTTP, with cookies, as a person's browser has it."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=20) as response:
            return response.read().decode()

    def log_in(self, username: str, password: str) -> None:
        page = self.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        form = urllib.parse.urlencode(
            {"csrfmiddlewaretoken": token, "username": username, "password": password, "next": "/admin/"}
        ).encode()
        with self.opener.open(self.base + "/admin/login/", form, timeout=20) as response:
            assert response.url.endswith("/admin/"), "the login was refused"


def test_the_handover_serves_the_demo_s_redis_data_and_database_in_the_admin(demo_result):
    created = manage(demo_result, "demo", "--run", "createsuperuser", "--noinput")
    assert created.returncode == 0, created.stderr
    redis_port, http_port = free_port(), free_port()
    serving = ManagedProcess(
        [
            sys.executable, "manage.py", "demo", "--serve",
            "--addrport", f"127.0.0.1:{http_port}", "--redis-port", str(redis_port),
        ],
        env=environment(demo_result),
        log=demo_result / "serve.log",
    )  # fmt: skip
    browser = Browser(f"http://127.0.0.1:{http_port}")
    try:

        def up() -> bool:
            try:
                return "login" in browser.get("/admin/login/")
            except OSError:
                return False

        assert wait_for(lambda: up() or not serving.alive(), 45, 0.3) and serving.alive(), serving.output()
        browser.log_in("operator", "demo-password")

        stuck = browser.get("/admin/queueapp/taskoutcome/stuck/")
        doubled = browser.get(f"/admin/lab/effect/?doubled=yes&run={RUN}-stock")
        everything = browser.get("/admin/lab/effect/")
    finally:
        if serving.alive():
            serving.process.send_signal(signal.SIGTERM)
            serving.process.wait(timeout=30)
        serving.stop()

    assert "Dead-lettered in Redis (1)" in stuck, stuck
    assert f"{RUN}-fenced-bad-json-1" in stuck and "malformed body" in stuck
    assert "2 lab effects" in doubled and "3 lab effects" in everything
    # SIGTERM stopped runserver and the Redis by their PIDs; the data stays for the next bin/admin.
    output = serving.output()
    assert f"127.0.0.1:{redis_port}" in output and f"faultlab/{RUN}/redis-fenced" in output
    assert wait_for(lambda: port_is_closed(redis_port) and port_is_closed(http_port), 15)
    assert (demo_result / "faultlab" / RUN / "redis-fenced" / "appendonlydir").is_dir()


def port_is_closed(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_serving_without_a_demo_result_says_to_run_the_demo(tmp_path):
    result = manage(tmp_path, "demo", "--serve")

    assert result.returncode != 0
    assert "run bin/demo first" in result.stderr
