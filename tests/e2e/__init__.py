"""End-to-end tests: real gasloc processes (see harness.py)."""
