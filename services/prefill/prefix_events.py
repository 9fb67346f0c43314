"""What this prefill worker's prefix cache holds, told to every router (proto `PrefixEvents`):
the changes after each batch that made some, and a snapshot on request. The cache numbers its
changes on the engine thread (shared/kv/prefix_cache.py); here they become messages."""
from __future__ import annotations

from baton.proto.internal import CachedPrefix, PrefixEvents
from baton.shared.kv.prefix_cache import Cached


def _plain(entries: list[Cached]) -> list[CachedPrefix]:
    return [CachedPrefix(blocks=e.blocks, digest=e.digest, tokens=e.tokens) for e in entries]


def changes_message(worker_id: str, instance_id: str, block: int,
                    changes: tuple[int, list[Cached], list[Cached]]) -> PrefixEvents:
    seq, added, evicted = changes
    return PrefixEvents(worker_id=worker_id, instance_id=instance_id, seq=seq, block=block,
                        added=_plain(added), evicted=_plain(evicted))


def snapshot_message(worker_id: str, instance_id: str, block: int, seq: int, held: list[Cached]) -> PrefixEvents:
    return PrefixEvents(worker_id=worker_id, instance_id=instance_id, seq=seq, block=block,
                        added=_plain(held), snapshot=True)
