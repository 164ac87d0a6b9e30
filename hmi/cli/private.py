"""``hmi private``: a private tenant on this machine (``hmi.split``): its adapter stays here, the
server runs only the root's frozen layers for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hmi.bootstrap import quiet_transformers
from hmi.cli.common import add_root_options, show
from hmi.model.catalog import root_spec
from hmi.split.client import BaseClient, BaseExecutorError
from hmi.split.model import Noise, PrivateModel


def cmd_private_infer(args) -> int:
    quiet_transformers()
    token = args.token or os.environ.get("HMI_TOKEN")
    if not token:
        raise SystemExit("hmi private infer: give the private tenant's --token (or HMI_TOKEN)")
    path = Path(args.adapter)
    if not path.exists():
        raise SystemExit(f"hmi private infer: no adapter archive {path}")
    spec = root_spec(args.root, args.l_low)
    base = BaseClient(args.url, token)
    try:
        model = PrivateModel(base, spec.model_dir, spec.l_low, PrivateModel.files_of(path.read_bytes()),
                             noise=Noise(base, scale=args.noise) if args.noise > 0 else None, max_len=args.max_len)
        show({"outputs": model.infer(args.texts, truncate=args.truncate), **base.stats})
    except (BaseExecutorError, ConnectionError) as exc:
        print(f"hmi: {exc}", file=sys.stderr)
        return 1
    return 0


def arguments(command: str, parser) -> None:
    sub = parser.add_subparsers(dest="private_cmd", required=True)
    inf = sub.add_parser("infer", help="run a private tenant's adapter here on texts, the root's frozen layers on the "
                                       "server")
    inf.add_argument("adapter", help="the adapter's folder as a zip (what `hmi tenant export` writes)")
    inf.add_argument("texts", nargs="+")
    inf.add_argument("--url", default=os.environ.get("HMI_URL", "http://127.0.0.1:8080"))
    inf.add_argument("--token", default=None, help="the private tenant's token (default: HMI_TOKEN)")
    inf.add_argument("--noise", type=float, default=1.0,
                     help="standard deviation of the noise that hides what the server sees (0: none; default 1)")
    inf.add_argument("--max-len", type=int, default=128, help="the server's token limit (default 128)")
    inf.add_argument("--truncate", action="store_true", help="cut texts over the limit instead of refusing them")
    add_root_options(inf)
    inf.set_defaults(func=cmd_private_infer)
