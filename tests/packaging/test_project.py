"""The repository's own requirements.txt runs its own manage.py, as a Django developer expects."""

from __future__ import annotations

import pytest

from tests.packaging.conftest import ROOT, Project

pytestmark = [pytest.mark.slow, pytest.mark.packaging]


def test_requirements_txt_alone_runs_manage_py_check_in_a_new_virtualenv(tmp_path, private_redis):
    project = Project(tmp_path, with_pip=False)
    project.pip("install", "--quiet", "--no-compile", "-r", str(ROOT / "requirements.txt"))
    project.cwd = ROOT
    project.env["REDIS_URL"] = f"redis://127.0.0.1:{private_redis.port}/0"
    project.env["QUEUEAPP_VAR_DIR"] = str(tmp_path / "var")

    result = project.python("manage.py", "check")

    assert "System check identified no issues" in result.stdout, result.stdout + result.stderr
    # Nothing of the checkout's development set came along: the check ran on requirements.txt alone.
    installed = project.pip("list", "--format", "freeze").stdout.lower()
    assert "pytest" not in installed and "dj-database-url" in installed
