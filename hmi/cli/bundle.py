"""``hmi bundle``: files carried to a machine that reaches no package registry, in pieces of a
given size each checked by sha256 on arrival (``hmi.bundle``)."""

from __future__ import annotations

import sys
from pathlib import Path

from hmi.bundle import BundleError, check, pack, unpack


def cmd_bundle(args) -> int:
    try:
        if args.action == "pack":
            def progress(done: int, total: int) -> None:
                print(f"\rpacked {done / 2**20:.0f} of {total / 2**20:.0f} MiB", end="", file=sys.stderr, flush=True)

            tty = sys.stderr.isatty()
            m = pack([Path(p) for p in args.paths], Path(args.bundle), int(args.piece_mb * 2**20), args.base,
                     progress if tty else None)
            if tty:
                print(file=sys.stderr)
            print(f"{args.bundle}: {len(m['files'])} files, {m['bytes'] / 2**20:.1f} MiB in {len(m['pieces'])} pieces of "
                  f"at most {args.piece_mb:g} MiB (sha256 {m['sha256'][:16]}...); on the other machine, once every "
                  f"piece and manifest.json is there: hmi bundle unpack {args.bundle} --into DEST")
        elif args.action == "check":
            s = check(Path(args.bundle))
            print(f"{args.bundle}: {s['present']} of {s['pieces']} pieces intact ({s['bytes'] / 2**20:.1f} MiB in all)"
                  + (f"; missing: {', '.join(s['missing'])}" if s["missing"] else "")
                  + (f"; damaged (size or sha256): {', '.join(s['damaged'])}" if s["damaged"] else ""))
            return 0 if not (s["missing"] or s["damaged"]) else 1
        else:
            m = unpack(Path(args.bundle), Path(args.into))
            print(f"unpacked {len(m['files'])} files ({m['bytes'] / 2**20:.1f} MiB, every piece's sha256 and every "
                  f"file's checked) into {args.into}")
    except BundleError as exc:
        print(f"hmi bundle {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


def arguments(command: str, parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("pack", help="write a new bundle folder of files and folders, in pieces")
    p.add_argument("bundle", help="the new folder")
    p.add_argument("paths", nargs="+", help="files and folders to carry (stored relative to --base)")
    p.add_argument("--piece-mb", type=float, default=48.0, help="the largest piece in MiB (default 48)")
    p.add_argument("--base", help="the folder the stored names are relative to (default: the working directory)")
    c = sub.add_parser("check", help="which pieces of a bundle are here and intact (exit 1 while any is not)")
    c.add_argument("bundle")
    u = sub.add_parser("unpack", help="check every piece, then write the files (each atomically)")
    u.add_argument("bundle")
    u.add_argument("--into", default=".", help="where the files go, under their stored names (default: here)")
    parser.set_defaults(func=cmd_bundle)
