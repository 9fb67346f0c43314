"""Fault injection for the sender's WRITEs, for tests of aborts and failures.

Set through `TransferAgent(faults=...)`, by assigning `agent.faults`, or for a whole service with
`BATON_TRANSFER_FAULTS="delay=1.5,fail=aux,drop=full"`. Faults act in Baton's code, not in NIXL:
- `delay_s`: hold every WRITE this long before posting it, as a slow transfer in flight would; an
  abort or deadline during the delay does not stop it (the worst case for the receiver).
- `fail`: do not post the WRITE that carries this component and report it as a NIXL error.
- `drop`: post the WRITE that carries this component without its notification.
- `metadata=truncate`: the agent publishes only the first half of its NIXL metadata (a worker
  whose registration the registry must refuse: metadata_check.py).
(A request goes as one WRITE of whole items and maybe one of byte ranges, each carrying several
components: `regions.resolve`.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV_VAR = "BATON_TRANSFER_FAULTS"


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    fail: str | None = None
    drop: str | None = None
    metadata: str | None = None

    @classmethod
    def from_env(cls) -> Faults:
        """Faults named in $BATON_TRANSFER_FAULTS (comma-separated key=value), none if unset."""
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return cls()
        fields: dict[str, str] = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("delay", "fail", "drop", "metadata") or (key == "metadata" and value != "truncate"):
                raise ValueError(f"{ENV_VAR}: expected delay=SECONDS, fail=COMPONENT, drop=COMPONENT or "
                                 f"metadata=truncate, got {item!r}")
            fields[key] = value
        return cls(float(fields.get("delay", 0.0)), fields.get("fail"), fields.get("drop"), fields.get("metadata"))
