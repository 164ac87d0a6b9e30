"""``hmi infer``, ``generate``, ``tenant`` and ``jobs``: clients of a running server (light:
nothing of the model side is imported)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hmi.adapters.spec import HEAD_DEFAULTS, KIND_OPTIONS, KINDS, AdapterSpec, misplaced_option
from hmi.archive import zip_folder
from hmi.cli.common import client, client_args, read_corpus_arg, read_rows_arg, run_client, show, wait_for_job
from hmi.data import task_labels
from hmi.training.serving import AUTO_RULE, SERVING_MODES


@run_client
def cmd_infer(args):
    show(client(args).infer(args.tenant, args.texts, truncate=args.truncate))


@run_client
def cmd_generate(args):
    body = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "seed": args.seed, "stop": args.stop}
    final = {}
    for msg in client(args).generate_stream(args.tenant, {k: v for k, v in body.items() if v is not None}):
        if msg.get("done"):
            final = msg
        elif "error" in msg:
            raise SystemExit(f"hmi: {msg['error']['message']}")
        else:
            print(msg["text"], end="", flush=True)
    print(f"\n[{final.get('tokens')} tokens, {final.get('finish_reason')}]", file=sys.stderr)


def adapter_body(args) -> dict:
    """The ``adapter`` object of a tenant create request: the kind (when given; else the server
    gives the task its default adapter) and the size options given; an option of another kind
    (``--rank`` with a bottleneck) is refused before anything is sent."""
    kind = args.kind or HEAD_DEFAULTS[args.type]["kind"]
    given = {key: getattr(args, key) for keys in KIND_OPTIONS.values() for key in keys if getattr(args, key) is not None}
    wrong = misplaced_option(kind, given)
    if wrong:
        default = "" if args.kind else f" (the default for --type {args.type})"
        raise SystemExit(f"hmi: --{wrong[0].replace('_', '-')} applies to --kind {wrong[1]}, not {kind}{default}")
    body = {"kind": args.kind, **given} if args.kind else dict(given)
    if "targets" in given:
        body["targets"] = given["targets"].split(",")
    return body


def training_rows(args) -> dict | None:
    """``training_data`` of a create or update command: the rows of --train and --dev, --hold-out's count."""
    if not args.train:
        if args.hold_out is not None:
            raise SystemExit("hmi: --hold-out goes with --train (a --dataset has its own dev split)")
        return None
    data = {"train": read_rows_arg(args.train), "dev": read_rows_arg(args.dev)}
    return data if args.hold_out is None else {**data, "hold_out": args.hold_out}


@run_client
def cmd_tenant_create(args):
    data = training_rows(args)
    if args.unlabeled:
        if data is None:
            raise SystemExit("hmi: --unlabeled goes with --train (with --dataset the domain corpus serves)")
        data["unlabeled"] = read_corpus_arg(args.unlabeled)
    adapter = adapter_body(args)
    labels = args.labels.split(",") if args.labels else None
    if labels is None and args.dataset:
        labels = task_labels(args.dataset)
    if not labels:
        raise SystemExit("hmi: give --labels (comma-separated) or --dataset")
    c = client(args)
    out = c.create_tenant(args.name, labels, args.type, data, args.dataset, args.domain, adapter,
                          args.max_train, args.epochs, pooling=args.pooling, truncate=args.truncate, distil=args.distil,
                          serving=args.serving)
    show(out)
    if args.wait:
        return wait_for_job(c, out["job"])


@run_client
def cmd_tenant_import(args):
    path = Path(args.archive)
    data = zip_folder(path) if path.is_dir() else path.read_bytes()
    show(client(args).import_adapter(args.name, data, model=args.model, truncate=args.truncate))


@run_client
def cmd_tenant_export(args):
    data = client(args).export_adapter(args.name)
    out = Path(args.out or f"{args.name}-adapter.zip")
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes)")


@run_client
def cmd_tenant_update(args):
    data = training_rows(args)
    c = client(args)
    out = c.update_tenant(args.name, data, args.dataset, args.max_train, args.epochs, args.distil, args.serving)
    show(out)
    if args.wait:
        return wait_for_job(c, out["job"])


@run_client
def cmd_tenant_delete(args):
    show(client(args).delete_tenant(args.name))


@run_client
def cmd_tenant_list(args):
    for t in client(args).tenants():
        if t.get("model") == "private":
            print(f"{t['name']:24s} {t['state']:10s} private (its adapter on its own side)")
            continue
        acc = ((t.get("metrics") or {}).get("test") or {}).get("accuracy")
        served = "whole" if t["spec"].get("whole") else "windows"  # on the full root, or on the PLOT
        print(f"{t['name']:24s} {t['state']:10s} {t['spec']['kind']:10s} {t['spec']['head']:14s} "
              f"labels={len(t['spec']['labels'])} served={served} test_acc={acc}")


@run_client
def cmd_jobs(args):
    c = client(args)
    if args.cancel:
        show(c.cancel_job(args.cancel))
        return
    for j in c.jobs():
        print(f"{j['id']}  {j['kind']:7s} {j['tenant']:24s} {j['state']:10s} progress={j.get('progress')}"
              + (f"  error={j['error']}" if j.get("error") else ""))


def arguments(command: str, parser) -> None:
    {"generate": _generate_args, "infer": _infer_args, "tenant": _tenant_args, "jobs": _jobs_args}[command](parser)


def _generate_args(gen) -> None:
    client_args(gen)
    gen.add_argument("tenant")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)


def _infer_args(inf) -> None:
    client_args(inf)
    inf.add_argument("tenant")
    inf.add_argument("texts", nargs="+")
    inf.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=None,
                     help="cut texts over the server's token limit (default: the tenant's setting)")
    inf.set_defaults(func=cmd_infer)


def _tenant_args(parser) -> None:
    ten = parser.add_subparsers(dest="tenant_cmd", required=True)
    _create_args(client_args(ten.add_parser("create", help="create a tenant (starts a fine-tune job)")))
    ti = client_args(ten.add_parser("import", help="bring your own adapter: upload an adapters-library folder (or PEFT "
                                    "LoRA folder with --model decoder), as a folder or a zip"))
    ti.add_argument("name")
    ti.add_argument("archive", help="the saved folder, or a zip of it")
    ti.add_argument("--model", default="encoder", choices=["encoder", "decoder"], help="the kind of a new tenant")
    ti.add_argument("--truncate", action="store_true",
                    help="a new encoder tenant cuts texts over the server's token limit instead of refusing them")
    ti.set_defaults(func=cmd_tenant_import)
    te = client_args(ten.add_parser("export", help="download a tenant's adapter as a zip (same format)"))
    te.add_argument("name")
    te.add_argument("-o", "--out", help="default: NAME-adapter.zip")
    te.set_defaults(func=cmd_tenant_export)
    tu = client_args(ten.add_parser("update", help="continue training a tenant on more data"))
    tu.add_argument("name")
    tu.add_argument("--dataset")
    tu.add_argument("--train")
    tu.add_argument("--dev")
    tu.add_argument("--max-train", type=int)
    tu.add_argument("--epochs", type=int)
    add_teaching_args(tu)
    tu.add_argument("--wait", action="store_true")
    tu.set_defaults(func=cmd_tenant_update)
    td = client_args(ten.add_parser("delete", help="delete a tenant"))
    td.add_argument("name")
    td.set_defaults(func=cmd_tenant_delete)
    tl = client_args(ten.add_parser("list", help="list tenants"))
    tl.set_defaults(func=cmd_tenant_list)


def _create_args(tc) -> None:
    tc.add_argument("name")
    tc.add_argument("--dataset", help="a prepared task (e.g. news-topic) as training data")
    tc.add_argument("--train", help="JSON Lines of {text,label} or {tokens,tags}")
    tc.add_argument("--dev", help="JSON Lines of dev rows: they choose the settings, the epoch and auto's serving "
                                  "(without them: --hold-out)")
    tc.add_argument("--labels", help="comma-separated label set (default: the dataset's)")
    tc.add_argument("--type", default="classification", choices=["classification", "tagging"])
    tc.add_argument("--kind", choices=KINDS,
                    help="the adapter (default: bottleneck for classification, LoRA of rank 16 on every linear layer "
                         "for tagging; on mpnet-base split 4+8 `--kind lora --rank 16 --alpha 16` scores higher for "
                         "classification: docs/roots.md)")
    spec = AdapterSpec.__dataclass_fields__
    tc.add_argument("--reduction-factor", type=int,
                    help=f"bottleneck: hidden size / bottleneck width (default {spec['reduction_factor'].default})")
    tc.add_argument("--rank", type=int, help=f"lora: the rank (default {spec['rank'].default}; "
                    f"{HEAD_DEFAULTS['tagging']['rank']} in a tagging task's default adapter)")
    tc.add_argument("--alpha", type=float,
                    help=f"lora: the scale's numerator, scale = alpha / rank (default {spec['alpha'].default:g})")
    tc.add_argument("--targets", help="lora: the projections it adapts, comma-separated of q, k, v, ffn_in, ffn_out, or "
                                      "'all' (default q,v; all in a tagging task's default adapter)")
    tc.add_argument("--pooling", choices=["cls", "mean"],
                    help="what a classification head reads: the [CLS] vector or the mean of the tokens (default: "
                         "the fine-tune tries both and keeps the better on dev; cls without dev examples, given or "
                         "held out; on mpnet-base the mean, as its accuracy tables read)")
    tc.add_argument("--domain", default="root")
    tc.add_argument("--max-train", type=int)
    tc.add_argument("--epochs", type=int)
    tc.add_argument("--unlabeled", metavar="FILE|CORPUS",
                    help="texts without labels like those the tenant will be asked about: a file of one per line, or "
                         "a prepared corpus (kept in the PLOT under compute+insert; with distillation, answered by the "
                         "teacher and trained on)")
    add_teaching_args(tc)
    tc.add_argument("--truncate", action="store_true",
                    help="cut texts over the server's token limit in training and inference (default: refuse them)")
    tc.add_argument("--wait", action="store_true", help="wait for the job and print it")
    tc.set_defaults(func=cmd_tenant_create)


def _jobs_args(jobs) -> None:
    client_args(jobs)
    jobs.add_argument("--cancel", metavar="JOB_ID")
    jobs.set_defaults(func=cmd_jobs)


def add_teaching_args(p) -> None:
    """A fine-tune's ``--hold-out``, ``--distil`` and ``--serving`` (create and update)."""
    p.add_argument("--hold-out", type=int, metavar="N",
                   help="without --dev: how many --train rows become the dev split that chooses the settings, the "
                        "epoch and auto's serving (default 0: every row trains)")
    p.add_argument("--distil", action=argparse.BooleanOptionalAction,
                   help="train a full-context teacher first and the served adapter on its answers too (more accurate "
                        "as served, several times the fine-tune's time; default: the server's)")
    p.add_argument("--serving", choices=SERVING_MODES,
                   help="windows (the PLOT and the adapter in the upper layers), whole (the teacher: the full root "
                        f"with the adapter in every layer; needs --distil) or auto ({AUTO_RULE}) (default: the "
                        "server's)")
