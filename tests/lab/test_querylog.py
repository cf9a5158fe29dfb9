"""How the bench counts commits and durable commits in a task's query log (no database needed)."""

from __future__ import annotations

from lab.bench.querylog import classify


def test_a_transaction_and_an_autocommit_write_are_commits_and_durable_by_default():
    counts = classify(["BEGIN", "INSERT INTO t VALUES (1)", "COMMIT", "UPDATE t SET n = 2", "SELECT 1"])
    assert counts == {"queries": 5, "commits": 2, "durable_commits": 2}


def test_postgresql_asynchronous_commits_are_not_durable():
    statements = [
        "BEGIN",
        "SET LOCAL synchronous_commit = off",
        "UPDATE t SET n = 1",
        "COMMIT",
        "WITH flush AS (SELECT set_config('synchronous_commit', 'off', true)) UPDATE t SET n = 2",
        "BEGIN",
        "UPDATE t SET n = 3",
        "COMMIT",
    ]
    assert classify(statements) == {"queries": 8, "commits": 3, "durable_commits": 1}


def test_sqlite_commits_below_full_synchronous_are_not_durable():
    statements = [
        "PRAGMA synchronous = NORMAL",
        "BEGIN IMMEDIATE",
        "UPDATE t SET n = 1",
        "COMMIT",
        "PRAGMA synchronous = 2",
        "BEGIN IMMEDIATE",
        "SAVEPOINT s1",
        "ROLLBACK TO SAVEPOINT s1",
        "UPDATE t SET n = 2",
        "COMMIT",
    ]
    assert classify(statements) == {"queries": 10, "commits": 2, "durable_commits": 1}
