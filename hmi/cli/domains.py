"""``hmi domain``: the version tree of domains, in ``HMI_HOME`` or through a server (``--url``)."""

from __future__ import annotations

import sys
from pathlib import Path

from hmi.cli.common import add_root_options, client, read_corpus_arg, run_client, show, wait_for_job
from hmi.cli.roots import load_current_root
from hmi.data import CORPORA
from hmi.home import hmi_home
from hmi.model.aliases import DEFAULT_ROOT
from hmi.services.registry import Registry
from hmi.training.further_pretrain import FPTConfig
from hmi.training.further_pretrain import summary as fpt_summary
from hmi.training.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, steps_help
from hmi.version_tree.tree import DomainError, VersionTree, forget_checkpoint


def _tree(args):
    """The version tree of the root ``--root``/``--l-low`` name (the default root at its default split):
    each root artifact has a tree of its own in the home."""
    return VersionTree(load_current_root(args.root, args.l_low))


def _domain_error(fn):
    def wrapped(args) -> int:
        try:
            return fn(args) or 0
        except DomainError as exc:
            print(f"hmi: {exc}", file=sys.stderr)
            return 2

    return wrapped


def _domain_via_server(args) -> bool:
    """Whether the command goes through a server (``--url``); the server's root serves its domains, so
    a root named as well is refused before anything is sent."""
    if not getattr(args, "url", None):
        return False
    if args.root != DEFAULT_ROOT or args.l_low is not None:
        raise DomainError("--root and --l-low choose the root of the local home's domains; through a server "
                          "(--url) the server's root serves them")
    return True


def _fpt_config(args):
    return FPTConfig(steps=args.steps, objective=args.objective or DEFAULT_OBJECTIVE)


@_domain_error
def cmd_domain_create(args):
    if _domain_via_server(args):
        return _domain_client(args, "create")

    tree, lines = _tree(args), read_corpus_arg(args.corpus)
    node = _kept_until_done(tree.resume_checkpoint("create", args.name), lambda checkpoint: tree.create(
        args.name, args.parent, lines, args.alpha, _fpt_config(args), checkpoint=checkpoint))
    print(f"domain {node.name}: parent {node.parent}, {node.plot['entries']} PLOT entries, its tri-grams covering "
          f"{node.corpus['covered_occurrences']:.1%} of tri-gram occurrences; {fpt_summary(node.fpt)}")


def _kept_until_done(checkpoint: Path, run):
    """``run(checkpoint)``, a local create or update that a stop does not lose: its distillation
    and PLOT build are kept at ``checkpoint`` (``VersionTree.resume_checkpoint``) until it ends, and
    the same command run again after Ctrl+C, a kill or a crash continues from them (a different
    corpus or setting starts over).  Says where it continued from."""
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    try:
        node = run(checkpoint)
    except KeyboardInterrupt:
        print("hmi: stopped; the same command run again continues from its last checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    except DomainError:
        forget_checkpoint(checkpoint)
        raise
    forget_checkpoint(checkpoint)
    step, entry = node.fpt.get("resumed_at_step"), node.plot.get("resumed_from")
    if step or entry:
        print(f"continued an earlier run of this command: distillation from step {step or 0}, "
              f"the PLOT build from entry {entry or 0}")
    return node


@run_client
def _domain_client(args, verb):
    c = client(args)
    if verb == "delete":
        show(c.delete_domain(args.name))
        return
    named = args.corpus in CORPORA and not Path(args.corpus).exists()
    corpus = None if named else [x.strip() for x in Path(args.corpus).read_text().splitlines() if x.strip()]
    kw = {"corpus": corpus, "corpus_name": args.corpus if named else None, "steps": args.steps,
          "objective": args.objective}
    out = c.create_domain(args.name, args.parent, alpha=args.alpha, **kw) if verb == "create" else \
        c.update_domain(args.name, **kw)
    show(out)
    if args.wait:
        return wait_for_job(c, out["job"])


@_domain_error
def cmd_domain_update(args):
    if _domain_via_server(args):
        return _domain_client(args, "update")

    tree, lines = _tree(args), read_corpus_arg(args.corpus)
    node = _kept_until_done(tree.resume_checkpoint("update", args.name), lambda checkpoint: tree.update(
        args.name, lines, _fpt_config(args), checkpoint=checkpoint))
    print(f"domain {node.name} updated: {node.corpus['lines']} corpus lines, {node.plot['entries']} PLOT entries; "
          f"{fpt_summary(node.fpt)}")


@_domain_error
def cmd_domain_delete(args):
    if _domain_via_server(args):
        return _domain_client(args, "delete")

    in_use = set()
    reg_path = hmi_home() / "registry"
    if reg_path.exists():
        reg = Registry(reg_path)
        in_use = {r.get("domain") for _, r in reg.items("tenants")}
        reg.close()
    _tree(args).delete(args.name, in_use)
    print(f"domain {args.name} deleted")


@run_client
def _domain_list_client(args):
    for d in client(args).domains():
        print(f"{'  ' * d.get('depth', 0)}{d['name']}  tenants={d.get('tenants')} "
              f"entries={(d.get('plot') or {}).get('entries')}")


@_domain_error
def cmd_domain_list(args):
    if _domain_via_server(args):
        return _domain_list_client(args)

    for d in _tree(args).listing():
        if d["name"] == "root":
            print("root")
            continue
        print(f"{'  ' * d['depth']}{d['name']}  alpha={d['alpha']} entries={d['plot'].get('entries')} "
              f"bytes={d['bytes']} corpus_lines={d['corpus'].get('lines')} "
              f"{fpt_summary(d['fpt'])}")
    return 0


def arguments(command: str, parser) -> None:
    dom = parser.add_subparsers(dest="domain_cmd", required=True)
    dc = _server_args(dom.add_parser("create", help="branch a domain: further-pretrain the lower layers, build a pruned "
                                     "PLOT"))
    dc.add_argument("--wait", action="store_true", help="with --url: wait for the job")
    dc.add_argument("name")
    dc.add_argument("--parent", default="root")
    dc.add_argument("--corpus", required=True, help="a prepared corpus name (e.g. legal) or a text file")
    dc.add_argument("--alpha", type=float, default=0.5, help="share of tri-gram occurrences the PLOT covers")
    dc.add_argument("--steps", type=int, default=None, help=f"further-pretraining steps (default: {steps_help()})")
    dc.add_argument("--objective", choices=OBJECTIVES, default=None,
                    help="further pretraining: distill the full root on the domain's text (default), or the paper's MLM")
    dc.set_defaults(func=cmd_domain_create)
    du = _server_args(dom.add_parser("update", help="continue further pretraining on more corpus and refresh the PLOT"))
    du.add_argument("--wait", action="store_true", help="with --url: wait for the job")
    du.add_argument("name")
    du.add_argument("--corpus", required=True)
    du.add_argument("--steps", type=int, default=None, help=f"further-pretraining steps (default: {steps_help()})")
    du.add_argument("--objective", choices=OBJECTIVES, default=None)
    du.set_defaults(func=cmd_domain_update)
    dd = _server_args(dom.add_parser("delete", help="delete a domain (refused while tenants use it)"))
    dd.add_argument("name")
    dd.set_defaults(func=cmd_domain_delete)
    dl = _server_args(dom.add_parser("list", help="the domain tree with sizes"))
    dl.set_defaults(func=cmd_domain_list)


def _server_args(p):
    p.add_argument("--url", default=None, help="act through this server instead of on HMI_HOME directly")
    p.add_argument("--token", default=None)
    add_root_options(p)  # the local home's root: its domains are that artifact's
    return p
