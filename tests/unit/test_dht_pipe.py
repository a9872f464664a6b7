"""runtime/dht_pipe.py: the DHT control pipe passes the MPFuture result pipe by reference, not as a descriptor
through multiprocessing's resource sharer (a socket handshake per DHT call); anything else pickles as before."""
import multiprocessing as mp
import pickle

import pytest

from gasloc.runtime.dht_pipe import FuturePipe


def test_the_inherited_result_pipe_travels_by_reference_and_other_pipes_as_before():
    r, w = mp.Pipe(duplex=False)
    sender_r, sender = mp.Pipe(duplex=False)
    other_r, other = mp.Pipe(duplex=False)
    out, inp = FuturePipe(w, sender), FuturePipe(r, sender)
    out.send(("_get", [], {"future_pipe": sender, "key": "k"}))
    assert inp.poll(1) and inp.fileno() == r.fileno()       # the rest is the wrapped Connection's
    method, _args, kw = inp.recv()
    assert method == "_get" and kw["key"] == "k" and kw["future_pipe"] is sender   # the very object, no new fd
    out.send({"pipe": other})                                # not the result pipe: a descriptor, as hivemind sends
    got = inp.recv()["pipe"]
    assert got is not other and got.fileno() != other.fileno()
    got.send_bytes(b"x")
    assert other_r.recv_bytes() == b"x"                      # the same pipe, through a duplicated descriptor
    got.close()
    sender.send_bytes(b"result")                             # results still come back on the one pipe
    assert sender_r.recv_bytes() == b"result"


def test_a_plain_unpickler_cannot_make_up_the_reference():
    r, w = mp.Pipe(duplex=False)
    _sr, sender = mp.Pipe(duplex=False)
    FuturePipe(w, sender).send([sender])
    with pytest.raises(pickle.UnpicklingError):   # a reference needs the receiving FuturePipe
        r.recv()
