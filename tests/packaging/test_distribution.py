"""The wheel holds both packages and their data, and needs the runtime set only, at versions CI tests."""

from __future__ import annotations

import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.packaging.conftest import ROOT

pytestmark = pytest.mark.packaging

RUNTIME = {"celery", "kombu", "redis", "django", "django-redis", "rich", "prometheus-client"}
#: What this repository's project (settings/) needs beyond the library: DATABASE_URL and PostgreSQL.
PROJECT = {"dj-database-url", "psycopg"}


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def requires(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` lines."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(line) for line in headers.get_all("Requires-Dist")]


def pins(path: Path) -> dict[str, str]:
    """``name == version`` lines of a requirements file, by canonical name."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            found[canonicalize_name(requirement.name)] = specifier.version
    return found


def test_the_wheel_holds_both_packages_with_their_lua_scripts_templates_sql_and_migrations(wheel):
    files = wheel_files(wheel)
    data = [
        *(ROOT / "broker_ext" / "lua").rglob("*.lua"),
        *(ROOT / "queueapp" / "templates").rglob("*.html"),
        *(path for path in (ROOT / "queueapp" / "static").rglob("*") if path.is_file()),
        *(ROOT / "queueapp" / "migrations").glob("*.py"),
        *(ROOT / "queueapp" / "records" / "sql").rglob("*.sql"),
    ]
    missing = sorted(str(path.relative_to(ROOT)) for path in data if str(path.relative_to(ROOT)) not in files)
    assert missing == []
    assert "broker_ext/lua/include/server_time.lua" in files


def test_the_wheel_leaves_out_the_lab_the_settings_and_the_tests(wheel):
    top_level = {name.split("/", 1)[0] for name in wheel_files(wheel)}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"broker_ext", "queueapp"}


def test_the_wheel_depends_on_the_runtime_set_only_with_hiredis_as_an_extra(wheel):
    required = {canonicalize_name(r.name) for r in requires(wheel) if r.marker is None}
    extras = {canonicalize_name(r.name) for r in requires(wheel) if r.marker is not None}
    assert required == RUNTIME
    assert extras == {"hiredis"}


def test_requirements_txt_pins_versions_the_package_accepts(wheel):
    pinned = pins(ROOT / "requirements.txt")
    for requirement in requires(wheel):
        name = canonicalize_name(requirement.name)
        assert requirement.specifier.contains(pinned[name]), f"{name}=={pinned[name]} vs {requirement}"


def test_requirements_txt_is_the_library_set_and_the_projects_own_and_dev_adds_only_tools(wheel):
    """requirements.txt runs this repository's manage.py; requirements-dev.txt re-pins none of it."""
    library = {canonicalize_name(r.name) for r in requires(wheel)}
    assert set(pins(ROOT / "requirements.txt")) == library | PROJECT
    dev = ROOT / "requirements-dev.txt"
    assert "-r requirements.txt" in dev.read_text().splitlines()
    assert set(pins(dev)) & set(pins(ROOT / "requirements.txt")) == set()


def test_requirements_lowest_txt_pins_exactly_the_lower_bounds_the_package_claims(wheel):
    lowest = pins(ROOT / "requirements-lowest.txt")
    for requirement in requires(wheel):
        if requirement.marker is not None:
            continue
        (bound,) = requirement.specifier
        assert bound.operator == ">=", requirement
        name = canonicalize_name(requirement.name)
        assert Version(lowest[name]) == Version(bound.version), (
            f"{name}: lowest pin {lowest[name]}, claimed {bound}"
        )
