"""``hmi private``: a private tenant on this machine (``hmi.split``): its adapter stays here, the
server runs only the root's frozen layers for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hmi.adapters.portable import RootShape, write_encoder
from hmi.archive import zip_files
from hmi.bootstrap import quiet_transformers
from hmi.cli.common import add_root_options, read_rows_arg, show
from hmi.data import hold_out
from hmi.model.artifact import ArtifactMismatchError, ArtifactMissingError
from hmi.model.catalog import root_spec
from hmi.split.client import BaseClient, BaseExecutorError
from hmi.split.lower import LocalLower
from hmi.split.model import PrivateModel
from hmi.split.noise import ClientNoise, ServerNoise
from hmi.split.train import finetune_private
from hmi.training.finetune import FinetuneConfig


def _model(args, verb: str) -> PrivateModel:
    """The private tenant's model from the command's adapter archive, root and noise."""
    quiet_transformers()
    token = args.token or os.environ.get("HMI_TOKEN")
    if not token and not (args.split == "blind" and args.lower == "client"):  # that one calls no server
        raise SystemExit(f"hmi private {verb}: give the private tenant's --token (or HMI_TOKEN)")
    path = Path(args.adapter)
    if not path.exists():
        raise SystemExit(f"hmi private {verb}: no adapter archive {path}")
    spec = root_spec(args.root, args.l_low)
    if args.split == "blind" and args.noise:
        raise SystemExit(f"hmi private {verb}: --noise hides the activations that --split projections sends; "
                         "the blind split sends none")
    if args.artifact and args.lower != "client":
        raise SystemExit(f"hmi private {verb}: --artifact calibrates the lower layers that --lower client runs here")
    lower = None
    if args.lower == "client":
        try:
            lower = LocalLower.load(spec.model_dir, spec.l_low, args.artifact)
        except (ArtifactMissingError, ArtifactMismatchError, ValueError, OSError) as exc:
            raise SystemExit(f"hmi private {verb}: {exc}") from exc
    base = None if args.split == "blind" and lower is not None else BaseClient(args.url, token)
    noise = None
    scale = 1.0 if args.noise is None else args.noise
    if args.split == "projections" and scale > 0:
        noise = (ServerNoise(base, scale=scale) if args.noise_effects == "server"
                 else ClientNoise(spec.model_dir, scale=scale))
    return PrivateModel(base, spec.model_dir, spec.l_low, PrivateModel.files_of(path.read_bytes()),
                        noise=noise, max_len=args.max_len, split=args.split, lower=lower)


def cmd_private_infer(args) -> int:
    try:
        model = _model(args, "infer")
        outputs = model.infer(args.texts, truncate=args.truncate)
        show({"outputs": outputs, **(model.base.stats if model.base is not None else {"round_trips": 0})})
    except (BaseExecutorError, ConnectionError) as exc:
        print(f"hmi: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_private_train(args) -> int:
    """Trains the archive's adapter further here and writes the result as an archive of the same
    format (loadable by the adapters library, uploadable as a hosted tenant)."""
    train, dev = read_rows_arg(args.train), read_rows_arg(args.dev)
    if args.hold_out and dev:
        raise SystemExit("hmi private train: --hold-out makes a dev split of --train's rows; --dev already gives one")
    try:
        train, dev, held = hold_out(train, dev, args.hold_out)
    except ValueError as exc:
        raise SystemExit(f"hmi private train: {exc}") from exc
    try:
        model = _model(args, "train")
        cfg = FinetuneConfig(epochs=args.epochs, max_len=args.max_len, seed=args.seed)
        weights, metrics = finetune_private(model, train, dev, cfg, progress=True)
    except (BaseExecutorError, ConnectionError) as exc:
        print(f"hmi: {exc}", file=sys.stderr)
        return 1
    c = model.config
    shape = RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, model.l_low, c.hidden_size)
    out = Path(args.out)
    out.write_bytes(zip_files(write_encoder(model.spec, weights, shape, out.stem), out.stem))
    show({"wrote": str(out), "dev": metrics["dev"], **({"dev_held_out": held} if held else {}),
          "epochs_run": metrics["epochs_run"], "round_trips": metrics["round_trips"], "seconds": metrics["seconds"]})
    return 0


def _common(p) -> None:
    p.add_argument("adapter", help="the adapter's folder as a zip (what `hmi tenant export` writes)")
    p.add_argument("--url", default=os.environ.get("HMI_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=None, help="the private tenant's token (default: HMI_TOKEN)")
    p.add_argument("--split", choices=("blind", "projections"), default="blind",
                   help="what the server runs: blind (default), the PLOT lookup alone, this machine the upper layers "
                        "whole from the public root, so nothing the server receives depends on the adapter or the "
                        "labels; projections, the upper layers' frozen projections too (less work here, but a "
                        "provider that predicts the activations recovers the adapter through the noise: "
                        "docs/private.md)")
    p.add_argument("--lower", choices=("server", "client"), default="server",
                   help="where the lower layers run: the server's PLOT lookup (default: it receives the token ids), "
                        "or this machine from the public root and its calibrated artifact, so no token id leaves it "
                        "(with --split blind the server is not called at all)")
    p.add_argument("--artifact", default=None,
                   help="with --lower client: the calibrated artifact folder the server serves (HMI_HOME/roots/<id>; "
                        "default: the one shipped for the root)")
    p.add_argument("--noise", type=float, default=None,
                   help="with --split projections: standard deviation of the noise on what the server sees "
                        "(0: none; default 1)")
    p.add_argument("--noise-effects", choices=("client", "server"), default="client",
                   help="who computes the noise's effect on each projection: this machine from the root's public "
                        "weights, the server never seeing a noise value (default), or the server (the Symbiosis "
                        "paper's scheme: one call per projection, and the server knows the values; see "
                        "docs/private.md)")
    p.add_argument("--max-len", type=int, default=128, help="the server's token limit (default 128)")
    add_root_options(p)


def arguments(command: str, parser) -> None:
    sub = parser.add_subparsers(dest="private_cmd", required=True)
    inf = sub.add_parser("infer", help="run a private tenant's adapter here on texts, the root's frozen layers on the "
                                       "server")
    _common(inf)
    inf.add_argument("texts", nargs="+")
    inf.add_argument("--truncate", action="store_true", help="cut texts over the limit instead of refusing them")
    inf.set_defaults(func=cmd_private_infer)
    tr = sub.add_parser("train", help="train a private tenant's adapter further here (AdamW), the frozen layers' "
                                      "forward and backward on the server")
    _common(tr)
    tr.add_argument("--train", required=True, help="JSON Lines of {text,label} or {tokens,tags}")
    tr.add_argument("--dev", help="JSON Lines for early stopping")
    tr.add_argument("--hold-out", type=int, metavar="N",
                    help="without --dev: how many --train rows (drawn with a fixed seed) become the dev split that "
                         "chooses the epoch (default 0: every row trains, the last epoch kept)")
    tr.add_argument("--epochs", type=int, default=4)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("-o", "--out", required=True, help="the trained adapter's archive (same format)")
    tr.set_defaults(func=cmd_private_train)
