"""What an over-long request costs before it is refused: 64 texts of 20,000 characters checked by
the token lower bound (``hmi.textlimit.words_exceed``) against tokenizing them all, as stage R did
before (real MiniLM tokenizer, offsets on).

Usage: python benchmarks/bench_limits.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, start, table, timeit  # noqa: E402


def main() -> None:
    args = start(__doc__)
    from hmi.data import load_task
    from hmi.model.root import default_spec, load_tokenizer
    from hmi.textlimit import words_exceed

    tok = load_tokenizer(default_spec().model_dir)
    limit = 128 - 2  # the server's default max_len, less [CLS] and [SEP]
    prose = " ".join(r["text"] for r in load_task("news-topic", "train", 40))
    cases = {
        "prose (BBC news), 20,000 chars": [prose[i * 7:i * 7 + 20_000] for i in range(64)],
        "'word ' x 4,000": ["word " * 4000] * 64,
        "one 20,000-char word (fits)": ["x" * 20_000] * 64,
    }
    repeat = 3 if args.quick else 9

    def checked(texts):
        keep = [t for t in texts if not words_exceed(t, limit)]
        return tok(keep, truncation=False, return_offsets_mapping=True) if keep else None

    rows, result = [], {}
    for name, texts in cases.items():
        refused = sum(words_exceed(t, limit) for t in texts)
        new = timeit(lambda: checked(texts), repeat)
        old = timeit(lambda: tok(texts, truncation=False, return_offsets_mapping=True), repeat)
        rows.append((name, f"{refused}/64", f"{new * 1e3:.2f}", f"{old * 1e3:.1f}", f"{old / new:.0f}x"))
        result[name.split(" ")[0].strip("'")] = {"refused": refused, "check_ms": round(new * 1e3, 3),
                                                  "tokenize_all_ms": round(old * 1e3, 2)}
    text = table(rows, ("64 texts", "refused before tokenizing", "check (+ tokenize what fits) ms",
                        "tokenize all ms (before)", "ratio"))
    finish("bench_limits", text, result, "python benchmarks/bench_limits.py")


if __name__ == "__main__":
    main()
