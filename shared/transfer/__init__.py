"""Bulk state transfer between workers over NIXL (UCX): prepared WRITEs from prefill into decode's
reserved slots, notification-driven arrival, and aborts that never free a slot a WRITE may still
land in. Threading rules: agent.py (event loop) and nixl_thread.py (the NIXL thread)."""
from .agent import PeerInfo, TransferAgent
from .arrivals import ArrivalEvent, ArrivalTracker, EventKind
from .faults import Faults
from .metrics import PeerStats, TransferMetrics
from .regions import AUX_KEY, TAG_BYTES, Descriptor, DescriptorError, Region
from .sender import TransferResult, TransferStatus

__all__ = [
    "AUX_KEY", "TAG_BYTES", "ArrivalEvent", "ArrivalTracker", "Descriptor", "DescriptorError",
    "EventKind", "Faults", "PeerInfo", "PeerStats", "Region", "TransferAgent", "TransferMetrics",
    "TransferResult", "TransferStatus",
]
