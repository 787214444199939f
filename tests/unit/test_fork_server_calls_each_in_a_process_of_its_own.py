"""tests/helpers_forkserver.py, which the memory tests measure with: each call in a child of its own,
forked from one server process; a child's skip skips the calling test, its exception fails the test
with the child's traceback, and the server serves on."""

import os
from pathlib import Path

import pytest
from helpers_forkserver import ForkServer


def child_facts(fail: str = "") -> dict:
    """This process's id and its parent's, or a call that skips or raises."""
    if fail == "skip":
        pytest.skip("skipped in the child")
    if fail == "raise":
        raise ValueError("raised in the child")
    return {"pid": os.getpid(), "parent": os.getppid()}


def test_each_call_runs_in_a_child_of_its_own_forked_from_one_server():
    with ForkServer(f"{Path(__file__).stem}:child_facts") as server:
        first, second = server(), server()
        assert first["parent"] == second["parent"] == server.proc.pid
        assert len({first["pid"], second["pid"], server.proc.pid, os.getpid()}) == 4
        with pytest.raises(AssertionError, match="ValueError: raised in the child"):
            server("raise")
        with pytest.raises(pytest.skip.Exception, match="skipped in the child"):
            server("skip")
        assert server()["parent"] == server.proc.pid  # the server outlives its children's failures
    assert server.proc.returncode is not None
