"""What the packaging tests share: the wheel (built once per run), a new project's virtualenv, a Redis."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]

#: What a copy of the checkout to build the wheel from leaves out: environments, run data, build output.
NOT_SOURCE = (
    ".git",
    ".venv*",
    "var",
    "node_modules",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
)

#: Variables of this test run that must not leak into a new project's processes.
PROJECT_UNSAFE_ENV = ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "QUEUEAPP_VAR_DIR", "DATABASE_URL", "REDIS_URL")
COMMAND_TIMEOUT = 300


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel`` of a copy of the checkout (no dependencies), in a temporary directory outside it.

    setuptools builds in the source tree (``build/``, ``*.egg-info``): built from the checkout itself,
    two runs at once (``bin/test`` runs its stages side by side) would write the same files.
    """
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source") / "project"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis a new project may use; AOF on, so that the persistence check has nothing to say."""
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


class Project:
    """A new virtualenv and the directory commands run in, with none of this test run's variables."""

    def __init__(self, root: Path, python: str = sys.executable, *, with_pip: bool = True) -> None:
        self.root = root
        self.venv = root / "venv"
        self.cwd = root
        self.env = {name: value for name, value in os.environ.items() if name not in PROJECT_UNSAFE_ENV}
        self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["VIRTUAL_ENV"] = str(self.venv)
        without = [] if with_pip else ["--without-pip"]  # then install() brings this run's pip
        subprocess.run([python, "-m", "venv", *without, str(self.venv)], check=True, timeout=COMMAND_TIMEOUT)

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``command`` in the project's directory and virtualenv; fail with its output if it fails."""
        result = subprocess.run(
            command,
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            **kwargs,
        )
        assert result.returncode == 0, f"{shlex.join(command)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    def python(self, *args: str) -> subprocess.CompletedProcess:
        return self.run([str(self.venv / "bin" / "python"), *args])

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        """This run's pip, acting on the project's virtualenv (which then needs no pip of its own)."""
        return self.run([sys.executable, "-m", "pip", "--python", str(self.venv / "bin" / "python"), *args])
