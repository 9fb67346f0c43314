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


def register(agent, table: RegionTable) -> tuple[Any, Any, bytes]:
    """Register every region once; prepare the per-item list; return them and our metadata."""
    reg = agent.register_memory([(r.addr, r.nbytes, 0, "") for r in table.regions], "DRAM")
    items = agent.prep_xfer_dlist(LOCAL, table.item_rows(), "DRAM")
    return reg, items, agent.get_agent_metadata()


def deregister(agent, reg: Any, items: Any) -> None:
    items.release()
    agent.deregister_memory(reg)


def connect(agent, metadata: bytes, table: RegionTable) -> tuple[str, Any]:
    """Load a peer's metadata; prepare its per-item list. Returns (its agent name, the list)."""
    name = agent.add_remote_agent(metadata)
    name = name.decode() if isinstance(name, bytes) else name
    items = agent.prep_xfer_dlist(name, table.item_rows(), "DRAM") if table.regions else None
    agent.make_connection(name)
    return name, items


def disconnect(agent, name: str, items: Any) -> None:
    if items is not None:
        items.release()
    agent.remove_remote_agent(name)


def post(agent, local_items: Any, peer: str, remote_items: Any, xfers: list[Xfer]) -> None:
    """Create and post each WRITE in order. With UCX cma the bytes are copied inside `transfer`."""
    for i, x in enumerate(xfers):
        if x.fail:
            x.state, x.error = "ERR", "injected failure"
            continue
        try:
            b = x.batch
            if b.by_item:
                x.handle = agent.make_prepped_xfer("WRITE", local_items, b.local, remote_items,
                                                   b.remote, x.notif)
            else:
                x.dlists = (agent.prep_xfer_dlist(LOCAL, b.local, "DRAM"),
                            agent.prep_xfer_dlist(peer, b.remote, "DRAM"))
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
