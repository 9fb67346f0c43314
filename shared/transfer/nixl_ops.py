"""The NIXL calls themselves. Every function here takes the nixl agent first and runs on the NIXL
thread only, through `NixlThread.run/call/submit`; `Xfer` records are touched by these functions
while the event loop awaits them, and read by the loop only between calls."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .regions import Batch, RegionTable

log = logging.getLogger(__name__)

LOCAL = "NIXL_INIT_AGENT"


@dataclass(eq=False)
class Xfer:
    """One WRITE of a request: its whole items or its byte ranges (`regions.resolve`).

    state: NEW -> PROC | DONE | ERR (NIXL's), CANCELLED (released while in flight: NIXL cancelled
    it), SKIPPED (never posted because an earlier post failed)."""
    batch: Batch
    notif: bytes  # b"" posts the WRITE without a notification
    fail: bool = False  # fault injection: report ERR instead of posting
    state: str = "NEW"
    error: str = ""
    handle: Any = None
    dlists: tuple = ()  # one-off prepared lists of a byte-range batch, released with the handle
    cancel_refused: bool = False


def register(agent, table: RegionTable) -> tuple[list[Any], dict[str, Any], bytes]:
    """Register every region once, each as its memory kind and device id; prepare one per-item
    list per kind; return the registrations, the lists (by kind) and our metadata."""
    regs = [_register_kind(agent, table, kind) for kind in table.kinds]
    items = {kind: agent.prep_xfer_dlist(LOCAL, table.item_rows(kind), kind) for kind in table.kinds}
    return regs, items, agent.get_agent_metadata()


def _register_kind(agent, table: RegionTable, kind: str) -> Any:
    try:
        return agent.register_memory([(r.addr, r.nbytes, r.device_id, "") for r in table.regions if r.mem_kind == kind],
                                     kind)
    except Exception as exc:
        if kind != "VRAM":
            raise
        raise RuntimeError(VRAM_UNREGISTERED) from exc


VRAM_UNREGISTERED = (
    "NIXL could not register the KV store's GPU memory (VRAM): its UCX has no working CUDA transport and "
    "sees the memory as host memory. nixl-cu12's UCX CUDA module needs CUDA 12's runtime (libcudart.so.12) "
    "and the driver's libcuda.so.1 and libnvidia-ml.so.1 on the library path; a machine with only CUDA 13's "
    "runtime (torch +cu13x) lacks the first: `pip install nvidia-cuda-runtime-cu12` and put its "
    "nvidia/cuda_runtime/lib on LD_LIBRARY_PATH (docs/deployment.md, NIXL / UCX)")


def deregister(agent, regs: list[Any], items: dict[str, Any]) -> None:
    for dlist in items.values():
        dlist.release()
    for reg in regs:
        agent.deregister_memory(reg)


def connect(agent, metadata: bytes, table: RegionTable) -> tuple[str, dict[str, Any]]:
    """Load a peer's metadata; prepare its per-item lists (one per memory kind). Returns (its
    agent name, the lists by kind)."""
    name = agent.add_remote_agent(metadata)
    name = name.decode() if isinstance(name, bytes) else name
    items = {kind: agent.prep_xfer_dlist(name, table.item_rows(kind), kind) for kind in table.kinds}
    agent.make_connection(name)
    return name, items


def disconnect(agent, name: str, items: dict[str, Any] | None) -> None:
    for dlist in (items or {}).values():
        dlist.release()
    agent.remove_remote_agent(name)


def post(agent, local_items: dict[str, Any], peer: str, remote_items: dict[str, Any], xfers: list[Xfer]) -> None:
    """Create and post each WRITE in order, from and to the lists of its memory kinds. With UCX
    cma the bytes are copied inside `transfer`."""
    for i, x in enumerate(xfers):
        if x.fail:
            x.state, x.error = "ERR", "injected failure"
            continue
        try:
            b = x.batch
            if b.by_item:
                x.handle = agent.make_prepped_xfer("WRITE", local_items[b.local_kind], b.local,
                                                   remote_items[b.remote_kind], b.remote, x.notif)
            else:
                x.dlists = (agent.prep_xfer_dlist(LOCAL, b.local, b.local_kind),
                            agent.prep_xfer_dlist(peer, b.remote, b.remote_kind))
                idx = np.arange(len(b.local), dtype=np.int32)
                x.handle = agent.make_prepped_xfer("WRITE", x.dlists[0], idx, x.dlists[1], idx, x.notif)
            x.state = agent.transfer(x.handle)
        except Exception as e:  # NIXL raises its own error types; the request fails, not the agent
            x.state, x.error = "ERR", error_text(e)
            for rest in xfers[i + 1:]:
                rest.state = "SKIPPED"
            return


def refresh(agent, xfers: list[Xfer]) -> None:
    """Update the state of WRITEs in flight (progresses UCX)."""
    for x in xfers:
        if x.state == "PROC":
            try:
                x.state = agent.check_xfer_state(x.handle)
            except Exception as e:
                x.state, x.error = "ERR", error_text(e)


def cancel(agent, xfers: list[Xfer], releasable: bool = True) -> None:
    """Release WRITEs still in flight; NIXL cancels them or refuses, and then they stay PROC.

    `releasable=False` (an agent with copy threads) never releases: NIXL's UCX thread pool
    accepts the release of a split WRITE while its chunks may still be copying on other
    workers, so the slots could be reused under a live WRITE. Such a WRITE is waited for."""
    for x in xfers:
        if x.state != "PROC":
            continue
        refusal = "its chunks may still be copying on the agent's copy threads"
        if releasable:
            try:
                x.handle.release()
                x.state = "CANCELLED"
                continue
            except Exception as e:
                refusal = str(e)
        if not x.cancel_refused:
            log.warning("WRITE of %s cannot be cancelled (%s); waiting for it to end",
                        x.batch.label, refusal)
        x.cancel_refused = True


def release(agent, xfers: list[Xfer]) -> None:
    """Free the handles of finished WRITEs (call once every Xfer is terminal) and drop them: a
    handle holds the agent, which must not outlive its thread through an Xfer (nixl_thread)."""
    for x in xfers:
        try:
            if x.handle is not None:
                x.handle.release()
            for dlist in x.dlists:
                dlist.release()
        except Exception as e:
            log.error("releasing the WRITE of %s failed: %s", x.batch.label, error_text(e))
        x.handle, x.dlists = None, ()


def notify(agent, peer: str, message: bytes) -> None:
    try:
        agent.send_notif(peer, message)
    except Exception as e:
        log.error("cannot send a notification to %r: %s", peer, error_text(e))


def error_text(e: BaseException) -> str:
    """An error as text: a log record or Xfer that kept the exception would keep the frames of
    its traceback, and with them the agent (nixl_thread)."""
    return f"{type(e).__name__}: {e}"
