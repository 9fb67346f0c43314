"""Held-out prompts: slices of the plays kept out of training (bench/heldout.txt)."""
from __future__ import annotations

import random
from pathlib import Path

from .tokenizer import TextTokenizer

HELDOUT_TEXT = Path(__file__).resolve().parents[2] / "bench" / "heldout.txt"


def heldout_prompts(tok: TextTokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` tokens from random places of the held-out text."""
    ids = tok.encode(HELDOUT_TEXT.read_text())
    rng = random.Random(seed)
    return [ids[s:s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]
