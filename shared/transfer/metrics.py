"""Per-peer transfer counters. Updated on the event loop thread only; read them from there."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PeerStats:
    bytes_written: int = 0  # bytes of WRITEs that completed (sender side)
    write_seconds: float = 0.0  # wall time of those WRITEs, post to completion
    writes: int = 0  # WRITEs that completed
    write_failures: int = 0  # WRITEs that failed, timed out or were aborted
    arrivals: int = 0  # requests whose state fully arrived from this peer (receiver side)
    arrival_failures: int = 0  # requests from this peer that ended in an error (receiver side)

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0


@dataclass
class TransferMetrics:
    peers: dict[str, PeerStats] = field(default_factory=dict)

    def peer(self, name: str) -> PeerStats:
        return self.peers.setdefault(name, PeerStats())
