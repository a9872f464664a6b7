"""Fixtures for tests that run real gasloc processes: `harness` (stops and checks every child, also on failure)
and `bootstrap` (a running `gasloc bootstrap` on loopback; yields its maddrs)."""
from __future__ import annotations

import pytest

from e2e.harness import Harness


def pytest_configure(config):
    config.addinivalue_line("markers", "light: an e2e test that trains one peer alone or a swarm stopped at its "
                            "first round or sooner, and whose verdict does not depend on the machine's pace: `make "
                            "test` runs these on three workers beside the unit tests, and every other e2e test alone")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path / "run")
    try:
        yield h
    finally:
        codes, clean_exit_leftovers, left = h.close()
        # A process that outlives SIGTERM + SIGKILL of its group escaped its session: always an error.
        # Sockets or shm files of a child that exited 0 mean its shutdown path leaks: an error too.
        # Those of a child killed by a signal (the test's kill -9, or our SIGKILL after a hung SIGTERM) are
        # expected (docs/hivemind.md §5) and were removed by h.close().
        problems = []
        if left.processes:
            problems.append(f"processes survived stopping their group: {left.processes}")
        if clean_exit_leftovers.sockets or clean_exit_leftovers.shm:
            problems.append(f"children that exited 0 left files behind: {clean_exit_leftovers}")
        if problems:
            pytest.fail("; ".join(problems) + f" (exit codes {codes})", pytrace=False)


@pytest.fixture
def bootstrap(harness):
    """maddrs of a `gasloc bootstrap` listening on 127.0.0.1, port 0."""
    return harness.bootstrap("bootstrap").maddrs
