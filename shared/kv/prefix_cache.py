"""Prefill's prefix cache: the state at the end of earlier prompts, so that a prompt which
extends one of them (the next turn of a conversation, the same prompt again) computes only its
new positions.

An entry is the end of one computed prompt of P0 tokens, or of one prefill chunk inside a prompt
(a boundary: there sliding storage holds the same positions; it lets prompts that share only the
first chunks, e.g. a long system prompt, start there) (docs/kv_state.md, "Prefix cache"):
    pages     its FULL pages, pinned in the KVStore (`KVStore.pin`) and shared, never written, by
              every request that starts from it
    sliding   the target's sliding layers' K/V of its last `span` positions, and
    hidden    the target hidden states of the same positions, both copied into a fixed pool of
              snapshot slots: [slots, sliding layers, span, 2, kv_heads, head_dim], [slots, span, d]
Sliding storage keeps `span = W + k` positions, so an entry can only be resumed near its end: a
prompt starts from it at any P with P0 - (span - W + 1) <= P <= P0 (and P < its own length, so the
last position is computed for the first token), where the entry's tokens and the prompt's agree
on 0..P-1. The hidden rows give the MTP draft window and decode's aux rows the same inputs a
full prefill would (draft state is recomputed from them, never cached stale).

A request that starts from P shares the entry's pages wholly below P - span (below its sliding
window, which in paged mode must be its own pages) and copies the pages from there up to P. Hits
are exact by construction: the tokens are compared in full, positions are the same, and a cache
belongs to one worker and so one model.

Eviction, when an insert finds every snapshot slot taken or an allocation lacks pages: the least
recently used entry that a later prompt extended from its very end (the previous turn of a
conversation whose next turn is cached: it only serves a regenerated or edited turn, and most
of its pages stay pinned by the newer entry), else the least recently used one. An evicted entry
unpins its pages, and a page goes back to the pool only once no request holds it either (a WRITE
in flight reads from a request's own holding). Engine thread only.

What it holds is told to routers (proto `PrefixEvents`, services/router/affinity.py): each entry is
a `Cached(blocks, digest, tokens)`, its index key (the whole blocks below the lowest position it
resumes from, and their chained digest, shared/kv/prefix_hash.py) and its end. Inserts and
evictions accumulate until `take_changes` numbers them (seq 1, 2, ...; cache_changes.py);
`snapshot` gives all the entries at a seq, so a router that missed a change can start over from it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from baton.shared.kv.allocator import IdPool, require
from baton.shared.kv.cache_changes import CacheChanges, Cached
from baton.shared.kv.prefix_hash import digests
from baton.shared.kv.routing import FULL
from baton.shared.kv.store import KVStore


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]  # the prompt, P0 = len(tokens)
    pages: list[int]  # its FULL pages, pinned
    slot: int  # snapshot slot: sliding K/V and hidden rows of positions lo .. P0-1
    lo: int  # max(0, P0 - span)
    extended: bool = False  # a later prompt continues it: the next turn, or (a chunk boundary) its own prompt


@dataclass(frozen=True)
class Hit:
    """Where a prompt starts from: positions 0..start-1 come from `entry`."""
    entry: Entry
    start: int

    def joined(self, cache: "PrefixCache", computed: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The cached hidden rows below `start` followed by `computed` (rows from `start` on):
        ([n, d] target hidden states, the position of the first)."""
        e = self.entry
        return torch.cat((cache.hidden[e.slot, :self.start - e.lo], computed)), e.lo


class PrefixCache:
    def __init__(self, store: KVStore, entries: int, hidden_size: int) -> None:
        self.store, self.span, self.ps = store, store.span, store.page_size
        # an entry resumes as low as P0 - reach: a chunk at P reads sliding positions P-W+1 .. P-1
        self.reach = store.span - store.cfg.sliding_window + 1
        self.sliding = [layer for key in store.keys if key.owner == "target" and key.kind != FULL
                        for layer in store.routing.layers_of(key)]
        row = (2, store.cfg.num_key_value_heads, store.cfg.head_dim)
        self.kv = torch.zeros((entries, len(self.sliding), self.span, *row),
                              dtype=store.dtype, device=store.device)  # [slots, sliding layers, span, 2, Hkv, D]
        self.hidden = torch.zeros((entries, self.span, hidden_size), dtype=store.dtype,
                                  device=store.device)  # [slots, span, d]
        self.slots = IdPool(entries, "prefix cache slots")
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # by id(entry), least recent first
        self._index: dict[tuple[int, int], list[Entry]] = {}  # (blocks, chain hash) -> entries keyed there
        self.hits = self.misses = self.evictions = 0
        self.changes = CacheChanges()  # what routers have not been told yet

    def __len__(self) -> int:
        return len(self._lru)

    def nbytes(self) -> int:
        """The snapshot pool's bytes (budget.prefix_cache_bytes); its pages are the store's."""
        return sum(t.numel() * t.element_size() for t in (self.kv, self.hidden))

    # --- lookup -------------------------------------------------------------------------------
    def match(self, prompt: list[int]) -> Hit | None:
        """The entry that lets `prompt` start furthest in, if any."""
        best: Hit | None = None
        chain = self._chain(prompt, len(prompt) // self.ps)
        for blocks, digest in enumerate(chain):
            for entry in self._index.get((blocks, digest), ()):
                start = self._start(entry, prompt)
                if start and (best is None or start > best.start):
                    best = Hit(entry, start)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._lru.move_to_end(id(best.entry))
        return best

    def _start(self, entry: Entry, prompt: list[int]) -> int:
        """Furthest position `prompt` may start from with this entry (0: none)."""
        P0 = len(entry.tokens)
        start = min(P0, len(prompt) - 1)
        if start < max(1, P0 - self.reach):
            return 0
        return start if tuple(prompt[:start]) == entry.tokens[:start] else 0

    # --- a request that starts from a hit (engine thread) ---------------------------------------
    def allocate(self, request_id: str, prompt: list[int], use: bool = True,
                 num_tokens: int | None = None) -> Hit | None:
        """Reserve the request's KV (`num_tokens` positions, default the prompt's), starting from
        the best entry when `use`; returns the hit (its prefill starts at `hit.start`) or None.
        Evicts entries for room when pages are short."""
        hit = self.match(prompt) if use else None
        shared = hit.entry.pages[:max(0, hit.start - self.span) // self.ps] if hit else []
        num_tokens = num_tokens or len(prompt)
        need = -(-num_tokens // self.ps) - len(shared)
        if need <= self.store.pages.num_free + self.store.reclaimable_pages():  # else evicting cannot help
            while self.store.pages.num_free < need and self._evict_one(keep=hit.entry if hit else None):
                pass
        self.store.allocate(request_id, num_tokens, tuple(shared))
        if hit is not None:
            self._restore(request_id, hit, len(shared))
        return hit

    def _restore(self, request_id: str, hit: Hit, shared: int) -> None:
        """Positions 0..start-1 of the request: copy the entry's pages from `shared` up to
        `start`, then its sliding rows the request's storage keeps."""
        store, entry, start = self.store, hit.entry, hit.start
        own = store.request(request_id).pages
        upto = -(-start // self.ps)
        src = torch.tensor(entry.pages[shared:upto], dtype=torch.long, device=store.device)
        dst = torch.tensor(own[shared:upto], dtype=torch.long, device=store.device)
        for key in store.keys:
            if key.kind == FULL and src.numel():
                store.data[key][dst] = store.data[key][src]  # whole items: every layer of each page
        store.extend(request_id, start)
        lo = max(entry.lo, store.request(request_id).floor)
        positions = torch.arange(lo, start, device=store.device)
        for i, layer in enumerate(self.sliding):
            rows = store.kv_rows(layer)
            rows[store.rows(request_id, layer, positions)] = self.kv[entry.slot, i, lo - entry.lo:start - entry.lo]

    # --- after a prompt is computed (engine thread) ---------------------------------------------
    def insert(self, request_id: str, prompt: list[int], hidden: torch.Tensor, hidden_start: int,
               hit: Hit | None = None, boundary: bool = False) -> None:
        """Keep the end of this computed prompt (`boundary`: of a chunk of it, `prompt` its tokens so
        far); `hidden` [L - hidden_start, d] its target hidden states from position hidden_start on
        (they must cover the last `span` positions); `hit`: where the prompt started from."""
        if hit is not None and hit.start == len(hit.entry.tokens):
            hit.entry.extended = True
        tokens = tuple(prompt)
        P0 = len(tokens)
        lo = max(0, P0 - self.span)
        if self.store.length(request_id) < P0:
            raise ValueError(f"request {request_id}: its prompt is not computed to its end")
        if hidden_start > lo:
            return  # it started from a longer entry that holds it (a prompt cut short of a cached one)
        if any(e.tokens == tokens for e in self._keyed(tokens)):
            return  # the same prompt again: its entry was touched by the lookup
        if self.slots.num_free == 0:
            self._evict_one()
        pages = self.store.request(request_id).pages[:-(-P0 // self.ps)]
        self.store.pin(pages)
        entry = Entry(tokens, pages, self.slots.take(1)[0], lo, extended=boundary)
        positions = torch.arange(lo, P0, device=self.store.device)
        for i, layer in enumerate(self.sliding):
            rows = self.store.kv_rows(layer)
            self.kv[entry.slot, i, :P0 - lo] = rows[self.store.rows(request_id, layer, positions)]
        self.hidden[entry.slot, :P0 - lo] = hidden[lo - hidden_start:P0 - hidden_start]
        self._lru[id(entry)] = entry
        self._index.setdefault(self._key(tokens), []).append(entry)
        self.changes.added(self._cached(entry))

    # --- eviction -------------------------------------------------------------------------------
    def reclaim(self) -> int:
        """Evict every entry (e.g. on a worker's drain); returns how many."""
        n = len(self._lru)
        while self._evict_one():
            pass
        return n

    def _evict_one(self, keep: Entry | None = None) -> bool:
        """Drop the least recently used extended entry, else the least recently used one, but
        never `keep`; False if there is none."""
        candidates = [(k, e) for k, e in self._lru.items() if e is not keep]
        if not candidates:
            return False
        key, entry = next(((k, e) for k, e in candidates if e.extended), candidates[0])
        del self._lru[key]
        keyed = self._index[self._key(entry.tokens)]
        keyed.remove(entry)
        if not keyed:
            del self._index[self._key(entry.tokens)]
        self.store.unpin(entry.pages)
        self.slots.give([entry.slot])
        self.evictions += 1
        self.changes.evicted(self._cached(entry))
        return True

    # --- what routers are told ------------------------------------------------------------------
    def take_changes(self) -> tuple[int, list[Cached], list[Cached]] | None:
        return self.changes.take()

    def snapshot(self) -> tuple[int, list[Cached]]:
        """(seq, every entry), changes not taken yet included (cache_changes.py)."""
        return self.changes.skip(), [self._cached(e) for e in self._lru.values()]

    def _cached(self, entry: Entry) -> Cached:
        blocks, digest = self._key(entry.tokens)
        return Cached(blocks, digest, len(entry.tokens))

    # --- index ----------------------------------------------------------------------------------
    def _key(self, tokens: tuple[int, ...]) -> tuple[int, int]:
        """An entry is indexed by the whole blocks below the lowest position it resumes from."""
        blocks = max(0, len(tokens) - self.reach + 1) // self.ps
        return blocks, self._chain(tokens, blocks)[-1]

    def _keyed(self, tokens: tuple[int, ...]) -> list[Entry]:
        return self._index.get(self._key(tokens), [])

    def _chain(self, tokens, blocks: int) -> list[int]:
        """Chained digests of the first 0..blocks whole blocks: [blocks + 1] (prefix_hash)."""
        return digests(tokens, self.ps, blocks)

    # --- integrity ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pins match the entries' pages, slots match the entries, the index holds each once."""
        self.slots.check_integrity()
        self.store.check_integrity()
        entries = list(self._lru.values())
        pins = torch.zeros(self.store.pages.size, dtype=torch.long, device="cpu")  # [P], as page_pins
        for e in entries:
            require(len(e.pages) == -(-len(e.tokens) // self.ps), "an entry's pages do not cover its tokens")
            pins[e.pages] += 1
        require(torch.equal(pins, torch.from_numpy(self.store.page_pins)), "prefix cache: pins out of sync")
        slots = [e.slot for e in entries]
        require(len(slots) == len(set(slots)) and set(slots) == self.slots.used, "prefix cache: slots out of sync")
        indexed = [e for keyed in self._index.values() for e in keyed]
        require(len(indexed) == len(entries) and {id(e) for e in indexed} == set(self._lru),
                "prefix cache: index and entries differ")
        for key, keyed in self._index.items():
            require(all(self._key(e.tokens) == key for e in keyed), "prefix cache: an entry under a wrong key")
