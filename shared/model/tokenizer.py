"""Byte-level BPE tokenizer (tokenizer.json from the `tokenizers` library); round-trips any UTF-8."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token_id = tokenizer.token_to_id(EOS_TOKEN)
        # the most UTF-8 bytes one token stands for (special tokens by their literal text)
        self.max_token_bytes = max(len(self.decode([i]).encode()) for i in range(self.vocab_size)) or 1

    @classmethod
    def load(cls, path: str | Path) -> "TextTokenizer":
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path)))

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without tokenizing: every token covers at most
        `max_token_bytes` bytes of the text."""
        return -(-len(text.encode()) // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the batch call releases the GIL, so other threads run meanwhile."""
        return self._tok.encode_batch([text])[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry itself (for byte-level BPE: bytes written in its printable alphabet)."""
        return self._tok.id_to_token(token_id)


def train_bpe(texts: list[str], vocab_size: int, path: str | Path) -> TextTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return TextTokenizer(tok)
