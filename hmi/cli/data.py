"""``hmi data``: the real datasets and domain corpora."""

from __future__ import annotations

from pathlib import Path

from hmi.data import data_dir
from hmi.data.prepare import prepare


def cmd_data_prepare(args) -> int:
    out = Path(args.out) if args.out else data_dir()
    stats = prepare(out, force=args.force)
    for name, s in stats["tasks"].items():
        print(f"task {name:18s} " + "  ".join(f"{p}={s[p]['n']}" for p in ("train", "dev", "test")))
    for name, s in stats["corpora"].items():
        print(f"corpus {name:12s} lines={s['lines']:7d} chars={s['chars']:9d}")
    return 0


def arguments(command: str, parser) -> None:
    data = parser.add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="fetch, normalize and split every task and corpus")
    prep.add_argument("--out", help="output folder (default: HMI_DATA_DIR or data/cache)")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.set_defaults(func=cmd_data_prepare)
