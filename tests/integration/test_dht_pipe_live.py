"""A SafeDHT's calls (run_coroutine, store, get) go through runtime/dht_pipe.py's FuturePipe and come back, on a
real DHT process: the result pipe it refers to is the one the forked child inherited."""
import os
import time

import pytest

from gasloc.runtime.dht_pipe import FuturePipe
from gasloc.runtime.safeproc import SafeDHT


async def _pid_of_dht_process(_dht, _node):
    return os.getpid()


@pytest.mark.timeout(60)
def test_a_safe_dht_answers_calls_through_the_wrapped_pipe():
    dht = SafeDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert isinstance(dht._outer_pipe, FuturePipe)
        for _ in range(3):
            assert dht.run_coroutine(_pid_of_dht_process) == dht.pid
        assert dht.store("k", 1, expiration_time=time.time() + 30) is True   # a lone node stores locally
        assert dht.get("k", latest=True).value == 1
        futures = [dht.get("k", return_future=True) for _ in range(20)]     # many in flight on the one pipe
        assert all(f.result(timeout=10).value == 1 for f in futures)
    finally:
        dht.shutdown()
