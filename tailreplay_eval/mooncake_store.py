"""Mooncake's distributed store as HiCache's L3 on this machine (`--hicache-storage-backend mooncake`).

The store is a master service (`mooncake_master`, shipped as a console script by the `mooncake-transfer-engine-non-cuda`
wheel pinned in requirements/cpu.lock) plus one client per server rank, which SGLang's `MooncakeStore` builds: each
client contributes a segment of its own memory to the shared pool and moves pages over the transfer engine's TCP
transport. Transfer metadata is exchanged peer to peer (`P2PHANDSHAKE`, SGLang's default), so no separate metadata
server runs. Run by hand (docs/tail-replay.md, "HiCache"):

    .venv/bin/mooncake_master -rpc_port 50051 -rpc_address 127.0.0.1 -metrics_port 9003
    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend mooncake \\
        --hicache-storage-backend-extra-config "$(python -m tailreplay_eval.mooncake_store 127.0.0.1:50051)"
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tailreplay_eval.server import ServerProcess, free_port

# SGLang parses `global_segment_size` as bytes or "<N>gb" only; a tiny model's pages fit in a few MiB.
SEGMENT_BYTES = 256 * 1024 * 1024


def extra_config(master: str, segment_bytes: int = SEGMENT_BYTES, **more) -> str:
    """`--hicache-storage-backend-extra-config` for a client of the master at `master` (host:port), over TCP on
    loopback: the transfer engine would otherwise advertise the machine's first interface and try RDMA."""
    return json.dumps({"master_server_address": master, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                       "device_name": "", "local_hostname": "127.0.0.1", "global_segment_size": segment_bytes,
                       **more})


def server_flags(master: str, segment_bytes: int = SEGMENT_BYTES, host_ratio: float = 4) -> tuple[str, ...]:
    """A server's HiCache flags with the store of the master at `master` as L3. The host pool is sized by
    `--hicache-ratio` (times the device pool): SGLang allocates a Mooncake backend's host pools through Mooncake's
    allocator, which maps them at once, so `--hicache-size` in whole GiB would take a GiB per server."""
    return ("--enable-hierarchical-cache", "--hicache-ratio", str(host_ratio), "--hicache-storage-backend", "mooncake",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", extra_config(master, segment_bytes))


@dataclass
class MooncakeMaster(ServerProcess):
    """`mooncake_master` on loopback, started, health-checked (its admin server's /health) and stopped by PID like a
    server. `restart()` brings it back on the same ports with an empty store."""

    model_path: str = ""
    spawn: bool = True  # not an SGLang server: never forked from the preforker
    metrics_port: int = field(default_factory=free_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(Path(sys.executable).with_name("mooncake_master")), "-rpc_port", str(self.port),
                "-rpc_address", "127.0.0.1", "-metrics_host", "127.0.0.1", "-metrics_port", str(self.metrics_port),
                *self.extra_args]

    def _ready(self) -> bool:
        r = requests.get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=5)
        return r.status_code == 200 and r.json().get("service_ready") is True

    def metric(self, name: str) -> float:
        """One value of the master's Prometheus metrics, e.g. `master_key_count`, `master_allocated_bytes`."""
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return float(value)
        raise KeyError(f"{name} not in the master's metrics")

    def restart(self) -> "MooncakeMaster":
        self.stop()
        return self.start().wait_healthy(timeout=60)


if __name__ == "__main__":
    print(extra_config(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))
