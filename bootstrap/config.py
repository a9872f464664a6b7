"""`gasloc bootstrap`'s configuration (resolved as defaults < TOML < GASLOC_* env < flags)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gasloc.peer.swarm.swarmkey import check_key_path
from gasloc.protocol.messages import check_run_id
from gasloc.runtime.maddrs import check_announce_ports, check_maddrs

DEFAULT_PORT = 31337


class BootstrapConfig(BaseModel):
    """A long-lived DHT node that peers dial first. It holds no model and takes no part in training."""
    model_config = ConfigDict(extra="forbid")

    run_id: str = Field("gasloc", description="the run whose swarm size is logged (estimated from the run's "
                        "bucket keys <run_id>_m<level>_<bucket>) and whose members it forwards for; the node serves "
                        "the DHT of any run")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP and UDP (QUIC) port on every interface "
                      "(0: any free port, for tests); ignored when host_maddrs is set")
    host_maddrs: list[str] | None = Field(None, description="multiaddrs to listen on; unset: "
                                          "/ip4/0.0.0.0/tcp/<port> and /ip4/0.0.0.0/udp/<port>/quic-v1")
    announce_maddrs: list[str] = Field(default_factory=list, description="multiaddrs peers should dial (a public "
                                       "IP behind NAT or a port forward; needs an explicit port); empty: the "
                                       "listen addresses")
    initial_peers: list[str] = Field(default_factory=list, description="other bootstrap nodes or peers to join "
                                     "(multiaddrs or files of them); empty: start a new DHT")
    identity_path: Path = Field(Path("bootstrap.key"), description="private key file giving a stable peer id; "
                                "created on first run; refused while another process uses it")
    key_path: Path | None = Field(None, description="swarm key file (gasloc keygen FILE) of a private swarm: "
                                  "DHT requests without that key are refused; unset: an open DHT")
    maddrs_file: Path | None = Field(None, description="write the node's full multiaddrs here (one per line, "
                                     "atomically) once it is up; peers take this file as --initial-peers")
    log_interval_s: float = Field(30.0, gt=0, description="log the swarm's size this often")
    request_timeout_s: float = Field(10.0, gt=0, description="timeout of the DHT lookup that counts the peers")
    startup_timeout_s: float = Field(30.0, gt=0, description="how long p2pd and the DHT may take to start")
    forwarding: bool = Field(True, description="forward streams between peers behind NAT that attach to this node "
                             "(so two NATed peers can exchange; costs twice the forwarded bytes of its link); it "
                             "also answers their reachability probes either way")
    forward_max_circuits: int = Field(16, ge=1, description="streams forwarded at once")
    forward_max_attached: int = Field(64, ge=1, description="peers behind NAT attached at once")
    forward_circuit_timeout_s: float = Field(60.0, gt=0, description="longest life of one forwarded stream")

    _run_id = field_validator("run_id")(check_run_id)
    _key = field_validator("key_path")(check_key_path)

    _maddrs = field_validator("host_maddrs", "announce_maddrs")(check_maddrs)
    _explicit_port = field_validator("announce_maddrs")(check_announce_ports)

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        from gasloc.runtime.maddrs import expand_initial_peers

        return expand_initial_peers(v)

    @property
    def listen_maddrs(self) -> list[str]:
        if self.host_maddrs:
            return list(self.host_maddrs)
        return [f"/ip4/0.0.0.0/tcp/{self.port}", f"/ip4/0.0.0.0/udp/{self.port}/quic-v1"]
