"""``hmi backup`` and ``hmi restore``: a consistent copy of a live home, and bringing one back."""

from __future__ import annotations

import sys
from pathlib import Path

from hmi.backup import BackupError, backup, restore
from hmi.home import hmi_home


def cmd_backup(args) -> int:
    home = Path(args.home) if args.home else hmi_home()
    try:
        manifest = backup(home, Path(args.dest))
    except BackupError as exc:
        print(f"hmi backup: {exc}", file=sys.stderr)
        return 2
    size = sum(f["bytes"] for f in manifest["files"].values())
    print(f"backed up {home} to {args.dest}: {len(manifest['files'])} files, {size / 2**20:.1f} MiB, "
          f"{manifest['seconds']} s (the server may keep running; `hmi restore {args.dest}` brings it back)")
    return 0


def cmd_restore(args) -> int:
    home = Path(args.home) if args.home else hmi_home()
    try:
        manifest = restore(Path(args.src), home, force=args.force)
    except BackupError as exc:
        print(f"hmi restore: {exc}", file=sys.stderr)
        return 2
    print(f"restored {len(manifest['files'])} files (every sha256 checked) into {home}; start a server on it with "
          f"HMI_HOME={home} hmi serve")
    return 0


def arguments(command: str, parser) -> None:
    parser.add_argument("--home", help="the home (default: HMI_HOME, else ~/.local/share/hmi)")
    if command == "backup":
        parser.add_argument("dest", help="a new folder for the copy")
        parser.set_defaults(func=cmd_backup)
    else:
        parser.add_argument("src", help="a folder `hmi backup` wrote")
        parser.add_argument("--force", action="store_true",
                            help="restore over a home that is not empty (it is moved aside, not deleted)")
        parser.set_defaults(func=cmd_restore)
