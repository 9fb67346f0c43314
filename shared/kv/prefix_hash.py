"""Chained digests of a prompt's whole blocks: how a prefill worker keys its prefix cache and how
routers match prompts against what the workers report (proto `PrefixEvents`).

    digests(tokens, block)[b] = digest of tokens[0 : b * block]   (b = 0 .. len // block)
    digests[0] = 0;  digests[b + 1] = blake2b-64(digests[b] as 8 bytes LE ++ block b as int32 LE)

A defined hash, not Python's `hash`: the router and the workers are separate processes, possibly
of other Python builds, and must agree on every digest. Plain Python, no torch (the router
imports it)."""
from __future__ import annotations

import hashlib
import struct


def digests(tokens, block: int, blocks: int | None = None) -> list[int]:
    """Digests of the first 0 .. `blocks` (default: all) whole blocks of `tokens`: [blocks + 1]."""
    n = len(tokens) // block if blocks is None else blocks
    raw = struct.pack(f"<{n * block}i", *tokens[:n * block])  # int32 little-endian, 4 bytes a token
    out, width = [0], 4 * block
    for b in range(n):
        seed = out[-1].to_bytes(8, "little")
        out.append(int.from_bytes(hashlib.blake2b(seed + raw[b * width:(b + 1) * width], digest_size=8).digest(),
                                  "little"))
    return out
