"""Decode's turn cache: the full-attention pages of finished requests' prompts, kept so that the
next turn of a conversation, which resends the whole history, gets those positions from decode's
own memory and prefill sends only the rest (sglang's decode-side radix cache for P/D does the
same).

An entry is the whole pages of a finished request's prompt, pinned in the KVStore (`KVStore.pin`),
with the prompt's tokens over them. Only prompt positions are kept: prefill wrote them, so they
hold exactly what prefill would send again; the positions decode generated itself are recomputed
by the next turn's prefill and travel (their values may differ from decode's by rounding, and a
reused row must be the row a full transfer brings). Sliding-window state always travels fresh:
the window of the new prompt's end covers new positions.

A new request's prompt shares the longest run of an entry's leading pages whose tokens it repeats,
but only pages wholly below its own sliding window (in paged mode those pages must be its own,
and in either mode nothing the request writes may be shared): at most `(L - span) // page_size`
pages for a prompt of L tokens. The allocation then says `reused` = those pages' positions, and
the transfer plan sends FULL components from there (plan.py). Entries are LRU, bounded by count,
and evicted when an allocation lacks pages; pin-only pages count as free capacity.

Routers are told what is held as prefill's prefix cache tells them (proto `PrefixEvents`, one
`Cached(blocks, digest, tokens)` per entry: its whole pages, their chained digest, its end).
Event loop only (decode reserves and frees there; kv/store.py).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from baton.shared.kv.allocator import KVError, require
from baton.shared.kv.cache_changes import CacheChanges, Cached
from baton.shared.kv.prefix_hash import digests
from baton.shared.kv.store import KVStore


@dataclass(eq=False)
class Turn:
    tokens: tuple[int, ...]  # the prompt's tokens over its whole pages: len = len(pages) * page_size
    pages: list[int]  # pinned
    chain: list[int]  # digests of its first 0 .. len(pages) pages (prefix_hash): its index keys

    def cached(self) -> Cached:
        """As routers see it: all its pages, their digest, where it ends."""
        return Cached(len(self.pages), self.chain[-1], len(self.tokens))


class TurnCache:
    def __init__(self, store: KVStore, entries: int) -> None:
        if entries < 1:
            raise ValueError(f"a turn cache needs at least one entry, got {entries}")
        self.store, self.ps, self.entries = store, store.page_size, entries
        self._lru: OrderedDict[int, Turn] = OrderedDict()  # by id(turn), least recent first
        self._index: dict[tuple[int, int], list[Turn]] = {}  # (pages, digest of their tokens) -> turns
        self.evictions = 0
        self.changes = CacheChanges()  # what routers have not been told yet

    def __len__(self) -> int:
        return len(self._lru)

    # --- a new request (reserve) ------------------------------------------------------------------
    def allocate(self, request_id: str, prompt: list[int], num_tokens: int) -> int:
        """Reserve `num_tokens` positions for the request, its first pages shared from the turn that
        its prompt repeats furthest (evicting others for room); returns the positions reused."""
        turn, pages = self._match(prompt)
        shared = turn.pages[:pages] if turn else []
        need = -(-num_tokens // self.ps) - len(shared)
        if need <= self.store.pages.num_free + self.store.reclaimable_pages():  # else evicting cannot help
            while self.store.pages.num_free < need and self._evict_one(keep=turn):
                pass
        self.store.allocate(request_id, num_tokens, tuple(shared))
        if turn is not None:
            self._lru.move_to_end(id(turn))
        return len(shared) * self.ps

    def _match(self, prompt: list[int]) -> tuple[Turn | None, int]:
        """The turn whose leading pages the prompt repeats furthest, and how many of them count."""
        limit = max(0, len(prompt) - self.store.span) // self.ps  # pages wholly below its window
        chain = digests(prompt, self.ps, limit)
        for pages in range(limit, 0, -1):
            for turn in self._index.get((pages, chain[pages]), ()):
                if turn.tokens[:pages * self.ps] == tuple(prompt[:pages * self.ps]):
                    return turn, pages
        return None, 0

    # --- a finished request (before it is freed) ----------------------------------------------------
    def keep(self, request_id: str, prompt: list[int]) -> None:
        """Keep the whole pages of a finished request's prompt."""
        n = len(prompt) // self.ps
        if n == 0:
            return
        tokens = tuple(prompt[:n * self.ps])
        chain = digests(tokens, self.ps)
        same = next((t for t in self._index.get((n, chain[n]), ()) if t.tokens == tokens), None)
        if same is not None:  # the same prompt again
            self._lru.move_to_end(id(same))
            return
        if len(self._lru) >= self.entries:
            self._evict_one()
        req = self.store.request(request_id)
        if req.length < n * self.ps:
            raise KVError(f"request {request_id}: its prompt is not in its pages")
        turn = Turn(tokens, req.pages[:n], chain)
        self.store.pin(turn.pages)
        self._lru[id(turn)] = turn
        for pages in range(1, n + 1):  # a prompt that repeats only its first pages shares those
            self._index.setdefault((pages, chain[pages]), []).append(turn)
        self.changes.added(turn.cached())

    # --- eviction ----------------------------------------------------------------------------------
    def _evict_one(self, keep: Turn | None = None) -> bool:
        key, turn = next(((k, t) for k, t in self._lru.items() if t is not keep), (None, None))
        if turn is None:
            return False
        del self._lru[key]
        for pages in range(1, len(turn.pages) + 1):
            keyed = self._index[(pages, turn.chain[pages])]
            keyed.remove(turn)
            if not keyed:
                del self._index[(pages, turn.chain[pages])]
        self.store.unpin(turn.pages)
        self.evictions += 1
        self.changes.evicted(turn.cached())
        return True

    def reclaim(self) -> int:
        """Evict every entry (e.g. when the worker stops); returns how many."""
        n = len(self._lru)
        while self._evict_one():
            pass
        return n

    # --- what routers are told (as prefix_cache.PrefixCache) --------------------------------------
    def take_changes(self) -> tuple[int, list[Cached], list[Cached]] | None:
        return self.changes.take()

    def snapshot(self) -> tuple[int, list[Cached]]:
        return self.changes.skip(), [t.cached() for t in self._lru.values()]

    # --- integrity ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The store's pins are the entries' pages (nothing else pins on decode); the bound holds and
        the index agrees."""
        self.store.check_integrity()
        pins = Counter(p for t in self._lru.values() for p in t.pages)
        held = {p: int(n) for p, n in enumerate(self.store.page_pins) if n}
        require(held == dict(pins), "turn cache: pins out of sync")
        require(len(self._lru) <= self.entries, "turn cache: more entries than its bound")
        indexed = Counter(id(t) for keyed in self._index.values() for t in keyed)
        require(indexed == Counter({id(t): len(t.pages) for t in self._lru.values()}),
                "turn cache: index and entries differ")
