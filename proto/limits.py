"""Size and range limits applied when decoding messages. One `Limits` per process, configurable."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Limits:
    # --- wire: a message decodes only into its declared types, so its size bounds every length ---
    max_message_bytes: int = 1 << 20  # NATS' default max_payload; a larger server setting may raise it
    # --- generate: what one request may ask for ---
    max_tokens: int = 4096  # completion tokens per request
    max_prompt_tokens: int = 1 << 17
    max_prompt_chars: int = 1 << 19
    max_stop: int = 16  # entries in `stop` and in `stop_token_ids`
    max_stop_chars: int = 256  # length of one stop string

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()
