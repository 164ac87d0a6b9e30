"""A lower bound on a text's token count that costs no tokenization, to refuse over-long inputs
before the tokenizer spends time on them (a 20,000-character text would otherwise be fully
tokenized only to be refused)."""

from __future__ import annotations

import re

# Chunks between the characters both tokenizer families split on: BERT's whitespace (space, \t,
# \n, \r and Unicode Zs); byte-level BPE splits on these and more, so it makes no fewer pieces.
_CHUNK = re.compile(r"[^ \t\n\r\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
# A chunk with a word character yields at least one token in both: WordPiece keeps letters and
# digits (a word it cannot split becomes [UNK]); byte-level BPE never drops a byte.
_WORD = re.compile(r"\w")


def words_exceed(text: str, limit: int) -> bool:
    """Whether ``text`` certainly tokenizes into more than ``limit`` tokens (special tokens not
    counted). Stops reading at the first chunk past the limit, so its cost is bounded by what the
    tokenizer would have to read anyway for a text that fits."""
    n = 0
    for m in _CHUNK.finditer(text):
        if _WORD.search(text, m.start(), m.end()):
            n += 1
            if n > limit:
                return True
    return False


class TooLongError(ValueError):
    """A tokenized text is over the limit and may not be cut (``row``: its index, when one of many)."""

    def __init__(self, n_tokens: int, limit: int, row: int | None = None):
        where = "" if row is None else f"row {row} has "
        super().__init__(f"{where}{n_tokens} tokens; the limit is {limit}")
        self.n_tokens, self.limit, self.row = n_tokens, limit, row


def fit_ids(ids: list, limit: int, truncate: bool) -> tuple[list, bool]:
    """A tokenized text (``[CLS] ... [SEP]``, or per-token targets aligned with it) within
    ``limit`` tokens, and whether it was cut: unchanged when it fits; with ``truncate``, its first
    ``limit - 1`` items and its last (the closing special token), as the tokenizer's own
    truncation of a single text makes it; otherwise :class:`TooLongError`.  Training and inference
    both read texts through this, so a tenant sees a text the same way in both."""
    if len(ids) <= limit:
        return ids, False
    if not truncate:
        raise TooLongError(len(ids), limit)
    return list(ids[:limit - 1]) + [ids[-1]], True
