"""`gasloc bootstrap`'s hint when p2pd does not start, from p2pd's own messages (as the p2pd bundled with
hivemind 1.1.12 words them)."""
from gasloc.bootstrap.node import start_hint


def test_unreachable_initial_peers_are_named():
    hint = start_hint("Daemon failed to start: 2026/12/03 13:39:45 failed to connect to bootstrap peers",
                      ["/ip4/0.0.0.0/tcp/31337"])
    assert "--initial-peers" in hint and "--host-maddrs" not in hint


def test_listen_failure_names_the_address_and_port():
    hint = start_hint("Daemon failed to start: failed to listen on any addresses: [listen tcp4 10.255.255.1:0: "
                      "bind: cannot assign requested address]", ["/ip4/10.255.255.1/tcp/4001"])
    assert "--host-maddrs" in hint and "gasloc doctor --port 4001" in hint and "--initial-peers" not in hint


def test_anything_else_names_both():
    hint = start_hint("Daemon failed to start: something new", ["/ip4/127.0.0.1/udp/9/quic-v1"])
    assert "--host-maddrs" in hint and "--initial-peers" in hint and "doctor" not in hint   # no TCP port to name
