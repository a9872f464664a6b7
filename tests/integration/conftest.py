"""Integration tests: real p2pd daemons on loopback. Select with `pytest tests/integration`."""
import pytest
from p2p_helpers import check_partner_leftovers


@pytest.fixture(scope="session", autouse=True)
def no_partner_leftovers():
    """Every subprocess partner, its p2pd and its socket files are gone when the session ends."""
    yield
    leftovers = check_partner_leftovers()
    assert not leftovers, f"partner leftovers: {leftovers}"
