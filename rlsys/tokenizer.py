"""The byte-level tokenizer shared by the model, the engine, the scaffolds and the trainer.

Ids 0..255 are raw bytes; a few special ids follow. Byte-level means every string has
exactly one encoding and decode(encode(s)) == s, so token ids can flow end to end between
turns with no re-tokenisation drift (docs/ARCHITECTURE.md, "One step of data flow"): the
scaffold appends the ids
of an observation to the ids the engine produced, never re-encodes the whole context.

Invariant: `VOCAB_SIZE` is the model's minimum vocabulary; configs may round it up.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTE_VOCAB = 256


@dataclass(frozen=True)
class SpecialTokens:
    bos: int = 256
    eos: int = 257
    pad: int = 258


SPECIAL = SpecialTokens()
VOCAB_SIZE = 259


class ByteTokenizer:
    """Encode text as UTF-8 bytes; decode ids back, skipping special ids."""

    vocab_size: int = VOCAB_SIZE
    bos_id: int = SPECIAL.bos
    eos_id: int = SPECIAL.eos
    pad_id: int = SPECIAL.pad

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special ids are dropped, invalid UTF-8 is replaced (never raises)."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def is_valid(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size
