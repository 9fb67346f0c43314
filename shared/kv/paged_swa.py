"""Paged sliding-window storage: SWA pages addressed through a full->SWA page mapping.

Every request owns a full page table (its FULL pages). Sliding layers do not get a page per full
page: `full_to_swa[full_page]` names the SWA page that holds that page's sliding K/V, or -1 when
the page is outside the resident window and its SWA page was released. Target and draft sliding
components share this one mapping (and so one set of SWA page ids).

A request reserves, at allocation, the most SWA pages it can ever map (`swa_pages_per_request`);
mapping and releasing move pages between its spare list and the mapping, so extending within
the reservation never fails.
"""
from __future__ import annotations

import torch

from baton.shared.kv.allocator import IdPool, require


class PagedSwa:
    def __init__(self, num_pages: int, num_swa_pages: int):
        # [P] in host memory (the engine builds its step metadata there); `table` is its numpy view
        self.full_to_swa = torch.full((num_pages,), -1, dtype=torch.long, device="cpu")
        self.table = self.full_to_swa.numpy()
        self.pool = IdPool(num_swa_pages, "SWA pages")
        self._spare: dict[str, list[int]] = {}  # request -> reserved, unmapped SWA pages
        self._mapped: dict[str, dict[int, int]] = {}  # request -> {full page: SWA page}

    @property
    def index_map_id(self) -> str:
        return f"full_to_swa@{self.full_to_swa.data_ptr():#x}"

    def reserve(self, request_id: str, n: int) -> None:
        self._spare[request_id] = self.pool.take(n)
        self._mapped[request_id] = {}

    def remap(self, request_id: str, full_pages: list[int]) -> None:
        """Make exactly `full_pages` mapped for this request: release the rest, then map these."""
        mapped, spare = self._mapped[request_id], self._spare[request_id]
        keep = set(full_pages)
        changed: dict[int, int] = {}
        for page in [p for p in mapped if p not in keep]:
            spare.append(mapped.pop(page))
            changed[page] = -1
        spare.sort(reverse=True)  # map the lowest free pages first: longer contiguous runs
        for page in full_pages:
            if page not in mapped:
                mapped[page] = changed[page] = spare.pop()
        if changed:
            self.table[list(changed)] = list(changed.values())

    def release(self, request_id: str) -> None:
        self.remap(request_id, [])
        self.pool.give(self._spare.pop(request_id))
        del self._mapped[request_id]

    def swa_page_ids(self, request_id: str, page_table: list[int]) -> tuple[int, ...]:
        mapped = self._mapped[request_id]
        return tuple(mapped.get(p, -1) for p in page_table)

    def check_integrity(self, page_tables: dict[str, list[int]]) -> None:
        self.pool.check_integrity()
        require(set(self._mapped) == set(page_tables), "SWA reservations differ from requests")
        held: list[int] = []
        for request_id, mapped in self._mapped.items():
            require(set(mapped) <= set(page_tables[request_id]),
                    f"request {request_id} maps SWA pages for full pages it does not own")
            held += list(mapped.values()) + self._spare[request_id]
        require(len(held) == len(set(held)), "an SWA page is held twice")
        require(set(held) == self.pool.used, "SWA pages taken but held by no request")
        expected = torch.full_like(self.full_to_swa, -1)
        for mapped in self._mapped.values():
            for page, swa_page in mapped.items():
                expected[page] = swa_page
        require(torch.equal(expected, self.full_to_swa), "full->SWA mapping out of sync")
