"""How fast an idle CPU must wake: a Linux PM QoS request held for the life of an engine process.

A CPU with nothing to run halts; on a VM the halted vCPU goes back to the host, and when work
comes it resumes on a core whose caches other work has since used. On the AMD EPYC VMs of stops
51-54 a 128-token prefill after 110 ms idle took 22.7-24.4 ms against 18.4 run back to back
(docs/benchmarks.md, stop 54); a disaggregated engine at low load idles between requests (prefill
while decode streams, decode while prefill computes), an aggregated one hardly. Holding
`/dev/cpu_dma_latency` at 0 keeps every CPU in its polling idle state instead: the same prefill
19.7-19.9 ms. The kernel drops the request when the file closes, also when the process dies, so
nothing outlives the engine. It costs what polling costs: idle CPUs look busy to the host.
"""
from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

CPU_LATENCY_QOS = Path("/dev/cpu_dma_latency")
LEAVE = -1  # the machine's own setting


def hold(us: int, device: Path | None = None) -> BinaryIO | None:
    """Ask that no CPU take longer than `us` microseconds to wake, while the returned file stays
    open (`device`: CPU_LATENCY_QOS). None for `LEAVE`, or (logged) where this process may not
    ask: not root, or no such device (a container without it, another OS)."""
    if us == LEAVE:
        return None
    device = device or CPU_LATENCY_QOS
    try:
        qos = open(device, "wb", buffering=0)
    except OSError as exc:
        log.warning("cpu_wake_latency_us %d not applied: cannot open %s (%s); CPUs idle as the machine "
                    "decides", us, device, exc.strerror or exc)
        return None
    qos.write(struct.pack("=i", us))
    log.info("CPUs wake within %d us while this process runs (%s)", us, device)
    return qos
