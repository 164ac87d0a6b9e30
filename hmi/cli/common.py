"""What the command groups share: client options and calls, printing, corpus and example-file arguments,
root options."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hmi.bootstrap import ensure_data
from hmi.client import ApiError, Client, load_rows
from hmi.data import CORPORA, corpus_texts
from hmi.model.aliases import ALIASES, DEFAULT_ROOT


def client(args):
    return Client(args.url, args.token)


def show(obj) -> None:
    print(json.dumps(obj, indent=1))


def run_client(fn):
    def wrapped(args) -> int:
        try:
            return fn(args) or 0
        except (ApiError, ConnectionError) as exc:
            print(f"hmi: {exc}", file=sys.stderr)
            return 1

    return wrapped


def read_corpus_arg(corpus: str) -> list[str]:
    """A prepared corpus, several joined by commas or ``all`` (``hmi.data.corpus_texts``), or a text file."""
    if corpus == "all" or all(name.strip() in CORPORA for name in corpus.split(",")):
        ensure_data()
        return corpus_texts(corpus)
    path = Path(corpus)
    if not path.exists():
        raise SystemExit(f"hmi: corpus {corpus!r} is neither a prepared corpus ({', '.join(CORPORA)}) nor a file")
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]


def read_rows_arg(path: str | None) -> list[dict]:
    """The examples of a ``--train``/``--dev`` file (none without one); a file that cannot be read,
    or a line that is not an example, stops the command with a message before anything is sent."""
    try:
        return load_rows(path) if path else []
    except ValueError as exc:
        raise SystemExit(f"hmi: {exc}") from None


def add_root_options(parser) -> None:
    parser.add_argument("--root", default=DEFAULT_ROOT,
                        help=f"an alias ({', '.join(ALIASES)}; default {DEFAULT_ROOT}) or a BERT/RoBERTa/MPNet "
                             "checkpoint folder (converted once into HMI_HOME)")
    parser.add_argument("--l-low", type=int, default=None,
                        help="how many lower layers become PLOT lookups (default: half the root's layers)")


def refuse_encoder_root_with_decoder(args, command: str, l_low_too: bool = True) -> None:
    """With ``--decoder`` a command works on the hGPT decoder root (SmolLM2-135M), so ``--root``
    (and, where the command serves the decoder's shipped split only, ``--l-low``) names an encoder
    root it would otherwise ignore in silence: refused before any work."""
    named = args.root != DEFAULT_ROOT or (l_low_too and args.l_low is not None)
    if args.decoder and named:
        also = " and --l-low name" if l_low_too else " names"
        raise SystemExit(f"hmi {command}: --decoder works on the decoder root (SmolLM2-135M); --root{also} an "
                         f"encoder root: run a second `hmi {command}` without --decoder for it")


def client_args(p):
    """The options of a command that calls a running server."""
    p.add_argument("--url", default=os.environ.get("HMI_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=None, help="default: HMI_TOKEN, HMI_ADMIN_TOKEN or $HMI_HOME/admin_token")
    return p
