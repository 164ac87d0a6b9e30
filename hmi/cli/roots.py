"""``hmi calibrate``, ``plot``, ``prepare``, ``demo`` and ``info``: the root, its calibrated lower
layers and its PLOTs (the model side: this module is imported only when one of them runs)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from hmi.adapters.shipped import as_shipped, shipped_for, trained_on, weights_sha256, write_shipped
from hmi.bootstrap import (
    calibrate_default,
    check_shipped,
    check_shipped_decoder,
    ensure_data,
    learn_served_backoff,
    prepare_decoder,
    prepare_default,
    quiet_transformers,
)
from hmi.cli.common import add_root_options, read_corpus_arg, refuse_encoder_root_with_decoder
from hmi.data import CORPORA, held_out_texts
from hmi.hgpt.runtime import DEFAULT_RANK
from hmi.home import hmi_home
from hmi.model.aliases import ALIASES, DECODER_L_LOW, DEFAULT_L_LOW, DEFAULT_ROOT, default_l_low, pointer_name, source_of
from hmi.model.artifact import (
    ArtifactMissingError,
    artifact_config,
    calibration_shortfall,
    current_artifact_id,
    load_root,
    uncalibrated,
)
from hmi.model.catalog import root_spec
from hmi.model.decoder import CausalLower
from hmi.model.root import full_forward, mean_pool, weights_fingerprint
from hmi.plot import learned
from hmi.plot.build import Selection, build_from_corpus, plot_corpus
from hmi.plot.learned import TRAIN_STEPS, resolve_policy
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.paths import artifact_plot_path, open_root_store, open_root_version, plot_meta, root_plot_path
from hmi.plot.store import PlotMissingError, PlotStore
from hmi.timelimit import EXIT_UNFINISHED
from hmi.training import backoff
from hmi.training.calibrate import CalibrationUnfinished
from hmi.training.calibrate_decoder import calibrate_and_save, decoder_recipe
from hmi.training.demo import DEMO_DECODER_TENANTS, DEMO_TENANTS, train_demo, train_demo_decoder


def cmd_calibrate_decoder(args) -> int:
    if args.check_shipped:
        if args.steps:
            raise SystemExit("hmi calibrate --decoder --check-shipped: the shipped windows are reproduced with the "
                             "defaults only")
        return report_check(*check_shipped_decoder(args.l_low or DECODER_L_LOW))
    l_low = args.l_low or DECODER_L_LOW
    cfg = decoder_recipe(l_low)
    if args.steps:
        cfg = replace(cfg, steps=args.steps)
    try:
        root, meta = calibrate_and_save(hmi_home(), l_low, cfg, max_minutes=args.max_minutes)
    except CalibrationUnfinished as exc:
        print(f"{exc}: run the same command again to continue", file=sys.stderr)
        return EXIT_UNFINISHED
    q = meta["quality"]
    print(f"decoder root {root.artifact_id}: perplexity on {q['eval_texts']} held-out texts: full model {q['ppl_full']}, "
          f"naive windows {q['ppl_naive_window']}, calibrated windows {q['ppl_calibrated']} "
          f"({meta['train_seconds']} s of training)")
    return 0


def report_check(shipped: str | None, made: str) -> int:
    """Prints and returns the verdict of ``--check-shipped`` (0: the shipped artifact is reproduced)."""
    print(f"shipped: {shipped or 'none for this root and split'}\ncalibrated now: {made}")
    print("identical, bit for bit" if shipped == made else "different")
    return 0 if shipped == made else 1


def cmd_calibrate(args) -> int:
    refuse_encoder_root_with_decoder(args, "calibrate", l_low_too=False)  # --l-low: the decoder's split
    # Options left out keep CalibrationConfig's defaults, stated there only.
    given = {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "corpus") if getattr(args, k) is not None}
    for k, v in {**given, "max_minutes": args.max_minutes}.items():
        if k != "corpus" and v is not None and not v > 0:
            raise SystemExit(f"hmi calibrate: --{k.replace('_', '-')} must be positive, got {v}")
    if args.bf16 is not None:
        given["bf16"] = args.bf16
    if args.corpus is not None:
        if args.decoder:
            raise SystemExit("hmi calibrate --decoder: the decoder's recipe fixes its text; --corpus is for encoder roots")
        if args.corpus != "all" and any(n.strip() not in CORPORA for n in args.corpus.split(",")):
            raise SystemExit(f"hmi calibrate: --corpus {args.corpus!r}: use all, or prepared corpus names among "
                             f"{', '.join(CORPORA)} joined by commas")
    quiet_transformers()

    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_data()
    if args.decoder:
        return cmd_calibrate_decoder(args)
    if args.check_shipped:
        if given or args.seed or not args.backoff or args.eval_texts != 256 or args.root != DEFAULT_ROOT:
            raise SystemExit("hmi calibrate --check-shipped: the shipped artifact is reproduced with the defaults only")
        return report_check(*check_shipped(args.l_low or DEFAULT_L_LOW))
    try:
        artifact_id, meta = calibrate_default(args.l_low, args.seed, args.backoff, args.eval_texts, root=args.root,
                                              max_minutes=args.max_minutes, **given)
    except CalibrationUnfinished as exc:
        print(f"{exc}: run the same command again to continue", file=sys.stderr)
        return EXIT_UNFINISHED
    print(f"root artifact {artifact_id}")
    print_quality(meta)
    return 0


def print_quality(meta: dict) -> None:
    q = meta.get("quality")
    if not q:
        return
    print(f"{'held-out real text':44s} {'before':>8s} {'after':>8s}")
    for key, name in (("lower_cosine", "cosine at layer L_low (token)"), ("pooled_cosine", "cosine of pooled output"),
                      ("lower_cosine_served", "cosine at layer L_low, as the PLOT serves"),
                      ("pooled_cosine_served", "cosine of pooled output, as the PLOT serves")):
        if key in q["before"] and key in q["after"]:
            print(f"{name:44s} {q['before'][key]:8.4f} {q['after'][key]:8.4f}")


def cmd_info(args) -> int:
    home = hmi_home()
    l_low = args.l_low or default_l_low(args.root)
    if l_low is None:
        raise SystemExit(f"hmi info: root {args.root!r} is a checkpoint folder: say --l-low")
    aid = current_artifact_id(home, pointer_name(source_of(args.root), l_low))
    print(f"HMI home: {home}")
    if aid is None:
        named = "" if args.root == DEFAULT_ROOT else f" --root {args.root} --l-low {l_low}"
        print(f"root artifact: none (run `hmi calibrate{named}`)")
        return 0
    meta = artifact_config(aid)
    print(f"root artifact: {aid}  root={meta['root']}  L_low={meta['l_low']}  hidden={meta['hidden_size']}")
    cal = meta.get("calibration", {})
    print(f"calibration: steps={cal.get('steps_done')} batch={cal.get('batch_size')} lr={cal.get('lr')} "
          f"seconds={cal.get('train_seconds', cal.get('train_seconds_this_run'))}")
    if shortfall := calibration_shortfall(meta):
        print(f"  {shortfall}")
    print_quality(meta)
    path = artifact_plot_path(aid, home)
    print_root_plot(path)
    print(f"`--miss-policy auto` serves: {learned.auto_choice(path, aid, source_of(args.root), l_low)} (docs/front.md)")
    if args.json:
        print(json.dumps(meta, indent=1))
    return 0


def print_root_plot(path: Path) -> None:
    """What the artifact's root PLOT at ``path`` holds: its size, the corpus it was built from, how
    far an unfinished build got, and the learned back-off beside it."""
    try:
        store = PlotStore(path, readonly=True)
    except PlotMissingError:
        print("root PLOT: none yet (`hmi prepare` builds it from the general corpus)")
        return
    try:
        stats, build, corpus = store.get_record("stats") or {}, store.get_record("build") or {}, plot_corpus(store)
    finally:
        store.close()
    if build and not build.get("complete"):
        size = f"build unfinished: {build.get('done', 0):,} of {build.get('total', 0):,} n-grams"
    else:
        size = f"{stats['entries']:,} n-grams, {stats['file_bytes'] / 2**20:,.0f} MiB" if stats else "size unrecorded"
    model = learned.fingerprint(path)
    print(f"root PLOT: {path} ({size}; built from the corpus {corpus!r}); learned back-off: "
          + (model or "none (`hmi prepare` trains it where `auto` serves one; `hmi plot learn-backoff`)"))


def parse_selection(text: str):
    if text == "all":
        return Selection("all")
    kind, _, value = text.partition(":")
    try:
        if kind == "alpha":
            return Selection("alpha", alpha=float(value))
        if kind == "top_k":
            return Selection("top_k", top_k=int(value))
    except ValueError as exc:
        raise SystemExit(f"hmi: bad --select {text!r}: {exc}")
    raise SystemExit(f"hmi: bad --select {text!r}; use all, alpha:A or top_k:K")


def load_current_root(root: str = DEFAULT_ROOT, l_low: int | None = None):
    quiet_transformers()

    try:
        if root in ALIASES:  # a root fetched on first use (mpnet-base) is not fetched where none is calibrated
            split = l_low or default_l_low(root)
            if current_artifact_id(None, pointer_name(source_of(root), split)) is None:
                raise uncalibrated(source_of(root), split)
        return load_root(spec=root_spec(root, l_low))
    except ArtifactMissingError as exc:
        raise SystemExit(f"hmi: {exc}")


def cmd_plot_build(args) -> int:
    refuse_encoder_root_with_decoder(args, "plot build")
    sel = parse_selection(args.select)
    lines = read_corpus_arg(args.corpus)
    if args.decoder:
        quiet_transformers()
        root = prepare_decoder(hmi_home())  # the shipped calibrated windows installed where the home has none
    else:
        root = load_current_root(args.root, args.l_low)
    out = Path(args.out) if args.out else root_plot_path(root)
    store = PlotStore(out, meta=plot_meta(root), readonly=False)
    try:
        summary = build_from_corpus(store, root.plot_lower, root.tokenizer, lines, sel, max_len=args.max_len,
                                    corpus=args.corpus)
    finally:
        store.close()
    if summary.get("up_to_date"):
        print(f"PLOT at {out} is already complete ({summary['entries']} entries)")
    else:
        print(f"PLOT at {out}: {summary['entries']} entries, {summary['file_bytes'] / 2**20:.1f} MiB on disk, "
              f"{summary['written']} computed in {summary['seconds']} s ({summary['ngrams_per_s']} n-grams/s), "
              f"selection {summary['selection']}, {summary['distinct_trigrams']} distinct corpus tri-grams")
    return 0


def cmd_plot_learn_backoff(args) -> int:
    """Trains (or resumes, or confirms) the learned back-off of a PLOT (the current root's by
    default): the model the miss policy ``learned`` serves missed tri-grams with."""
    if args.steps < 1:
        raise SystemExit(f"hmi plot learn-backoff: --steps must be at least 1, got {args.steps}")
    path = Path(args.path) if args.path else root_plot_path(load_current_root(args.root, args.l_low))
    try:
        store = PlotStore(path, readonly=True)
    except PlotMissingError as exc:
        raise SystemExit(f"hmi plot learn-backoff: {exc} (build it with `hmi plot build`)")
    try:
        record = backoff.train(store, backoff.TrainConfig(steps=args.steps))
    except ValueError as exc:
        raise SystemExit(f"hmi plot learn-backoff: {exc}")
    finally:
        store.close()
    state = "already trained" if record.get("up_to_date") else f"trained in {record['seconds']} s"
    print(f"learned back-off of the PLOT at {path}: {state} ({record['steps']} steps); held-out cosine per "
          f"window row: back-off {record['held_out_cosine_backoff']}, learned {record['held_out_cosine_learned']}")
    return 0


def cmd_plot_stats(args) -> int:
    store = PlotStore(args.path, readonly=True)
    print(json.dumps({"meta": store.meta.__dict__, "stats": store.stats(), "build": store.get_record("build")},
                     indent=1))
    return 0


def cmd_prepare(args) -> int:
    """Data, calibrated root, root PLOT and the learned back-off ``auto`` serves on the root
    (``learn_served_backoff``) of the embedded default (with ``--decoder``, the hGPT decoder root
    and its causal PLOT), each only when missing."""
    refuse_encoder_root_with_decoder(args, "prepare")
    quiet_transformers()
    if args.decoder:
        ensure_data()
        gpt = prepare_decoder(hmi_home(), plot=True)
        print(f"ready: decoder root {gpt.artifact_id} and its causal PLOT in {hmi_home()}")
        return 0
    root = prepare_default(hmi_home(), args.root, args.l_low)
    store = open_root_store(root)
    try:
        learned_record = learn_served_backoff(root, store)
    finally:
        store.close()
    also = f" (its learned back-off trained in {learned_record['seconds']} s)" if learned_record else ""
    print(f"ready: root {root.artifact_id} and its root PLOT{also} in {hmi_home()}")
    return 0


def demo_trainings(home: Path, decoder: bool):
    """(demo tenant, its fine-tune as a thunk, what it is trained on) for each encoder demo tenant,
    or with ``decoder`` for the decoder's (its causal PLOT built first where it is not)."""
    if decoder:
        gpt = prepare_decoder(home, plot=True)
        store = open_root_store(gpt, home)
        lookup = PlotLookup([PlotVersion("root", store, CausalLower(gpt))], policy="compute")  # as a server's
        identity = trained_on(gpt.artifact_id, weights_fingerprint(gpt.model), store, lookup.policy)
        return [(d, lambda d=d: train_demo_decoder(d, gpt, lookup, DEFAULT_RANK), identity) for d in DEMO_DECODER_TENANTS]
    root = prepare_default(home)
    version = open_root_version(root)
    lookup = PlotLookup([version], policy=resolve_policy("auto", version, root))  # a default server's
    identity = trained_on(root.artifact_id, weights_fingerprint(root.bert), version.store, lookup.policy)
    return [(d, lambda d=d: train_demo(d, root.bert, root.l_low, lookup, root.tokenizer), identity) for d in DEMO_TENANTS]


def cmd_ship_demo(check: bool, decoder: bool) -> int:
    """``hmi demo --ship`` / ``--check-shipped``: the demo tenants' adapters trained as their jobs
    train them, written into the package or compared with what it holds."""
    same = True
    for d, train, identity in demo_trainings(hmi_home(), decoder):
        spec, weights, metrics = train()
        digest = weights_sha256(as_shipped(weights))
        if check:
            shipped = shipped_for(d["name"], **identity)
            ok = shipped is not None and shipped.meta["weights_sha256"] == digest
            same &= ok
            print(f"{d['name']}: shipped {shipped.meta['weights_sha256'][:16] if shipped else 'none for this root'}, "
                  f"trained now {digest[:16]}: {'identical, bit for bit' if ok else 'different'}")
            continue
        summary = {k: metrics[k] for k in ("dev", "test", "epochs_run", "dev_ppl_before", "dev_ppl_after", "steps", "seconds")
                   if k in metrics}
        folder = write_shipped(d["name"], spec, weights, {**identity, "metrics": summary, "recipe": d,
                                                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                                                          "cpu": torch.backends.cpu.get_cpu_capability()})
        print(f"{d['name']}: {json.dumps(summary)}, written to {folder}")
    return 0 if same else 1


def cmd_demo(args) -> int:
    """Set-up of the embedded default and a look at what it computes."""
    quiet_transformers()
    if args.ship or args.check_shipped:
        return cmd_ship_demo(args.check_shipped, args.hgpt)


    root = prepare_default(hmi_home())
    print(f"root artifact {root.artifact_id}")
    print_quality(root.meta)
    lookup = PlotLookup([open_root_version(root)], policy="compute")
    texts = held_out_texts(8)
    enc = root.tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"], enc["attention_mask"]

    with torch.no_grad():
        out = root.hplm().upper(lookup.merged(ids, mask), torch.from_numpy(mask))
        ref = full_forward(root.bert, torch.from_numpy(ids), torch.from_numpy(mask))[-1]
    cos = torch.nn.functional.cosine_similarity(mean_pool(out, torch.from_numpy(mask)),
                                                mean_pool(ref, torch.from_numpy(mask)))
    print(f"\n{'text (held-out)':60s} {'cos to full model':>18s}")
    for t, c in zip(texts, cos.tolist()):
        print(f"{t[:58]:60s} {c:18.4f}")
    print(f"PLOT hits: {dict(lookup.hits)}")
    return 0


def arguments(command: str, parser) -> None:
    {"calibrate": _calibrate_args, "plot": _plot_args, "prepare": _prepare_args, "demo": _demo_args,
     "info": _info_args}[command](parser)


def _calibrate_args(cal) -> None:
    cal.add_argument("--decoder", action="store_true", help="calibrate the hGPT decoder root (SmolLM2-135M) instead")
    cal.add_argument("--steps", type=int, default=None,
                     help="default 600 (encoder; 1600 for mpnet-base), 150 (decoder; 300 deeper than 2 layers)")
    cal.add_argument("--batch-size", type=int, default=None, help="default 32 (encoder)")
    cal.add_argument("--lr", type=float, default=None, help="default 5e-4 (encoder; 3e-4 for mpnet-base)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--root", default=DEFAULT_ROOT,
                     help=f"an alias ({', '.join(ALIASES)}; default {DEFAULT_ROOT}) or a BERT/RoBERTa/MPNet checkpoint folder")
    cal.add_argument("--l-low", type=int, default=None,
                     help="lower layers: default half the root's (3 of 6, 6 of 12); decoder: 2 of 30")
    cal.add_argument("--max-minutes", type=float, default=None,
                     help="limit this invocation (default: none): past it, the calibration stops at a "
                          "checkpoint and exits with status 75; the same command continues it. The recipe (steps, "
                          "schedule) is the same however many invocations it takes")
    cal.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                     help="the training steps' matrix products in bf16 where the CPU computes bf16 natively "
                          "(AVX512_BF16, AMX), fp32 elsewhere (default: the root's recipe, on for mpnet-base)")
    cal.add_argument("--corpus", default=None,
                     help="the text to distil on: general (an equal share of every domain, 1.8M characters; the default "
                          "root's recipe), all (every domain corpus, about 32M; mpnet-base's recipe) or prepared "
                          "corpus names joined by commas")
    cal.add_argument("--eval-texts", type=int, default=256)
    cal.add_argument("--threads", type=int, default=0)
    cal.add_argument("--no-backoff", dest="backoff", action="store_false",
                     help="train every window computed, not as the PLOT serves text (windows it misses back off)")
    cal.add_argument("--check-shipped", action="store_true",
                     help="calibrate with the defaults in a throw-away home and compare with the artifact shipped "
                          "in the package (same CPU kind, torch and thread count: identical bit for bit); with "
                          "--decoder, the decoder's shipped windows")
    cal.set_defaults(func=cmd_calibrate)


def _plot_args(parser) -> None:
    plot = parser.add_subparsers(dest="plot_cmd", required=True)
    pb = plot.add_parser("build", help="build (or resume) a PLOT from a corpus")
    pb.add_argument("--corpus", default="general", help="a prepared corpus name or a text file (one line each)")
    pb.add_argument("--out", help="LMDB folder (default: the current root's root PLOT)")
    pb.add_argument("--select", default="all", help="all, alpha:A (coverage) or top_k:K")
    pb.add_argument("--max-len", type=int, default=128)
    pb.add_argument("--decoder", action="store_true", help="a causal PLOT of the calibrated hGPT decoder root")
    add_root_options(pb)
    pb.set_defaults(func=cmd_plot_build)
    pl = plot.add_parser("learn-backoff", help="train (or resume) a PLOT's learned back-off, the model the miss "
                                               "policy `learned` serves missed tri-grams with")
    pl.add_argument("--path", help="LMDB folder (default: the current root's root PLOT)")
    pl.add_argument("--steps", type=int, default=TRAIN_STEPS)
    add_root_options(pl)
    pl.set_defaults(func=cmd_plot_learn_backoff)
    ps = plot.add_parser("stats", help="entries and bytes of a PLOT")
    ps.add_argument("path")
    ps.set_defaults(func=cmd_plot_stats)


def _prepare_args(parser) -> None:
    add_root_options(parser)
    parser.add_argument("--decoder", action="store_true",
                        help="the hGPT decoder root (SmolLM2-135M: the calibrated windows shipped with hmi where "
                             "they fit, else calibrated) and its causal PLOT, instead of the encoder root")
    parser.set_defaults(func=cmd_prepare)


def _demo_args(parser) -> None:
    parser.add_argument("--ship", action="store_true",
                        help="train the demo tenants' adapters on the prepared default root and its root PLOT as "
                             "their server jobs do, and write them into the package (hmi/adapters/shipped/)")
    parser.add_argument("--check-shipped", action="store_true",
                        help="train them again and compare with the shipped ones (same CPU kind, torch and thread "
                             "count: identical bit for bit)")
    parser.add_argument("--hgpt", action="store_true",
                        help="with --ship or --check-shipped: the decoder demo tenant instead (hmi serve --hgpt's; "
                             "builds the decoder's causal PLOT first where it is not)")
    parser.set_defaults(func=cmd_demo)


def _info_args(parser) -> None:
    parser.add_argument("--json", action="store_true")
    add_root_options(parser)
    parser.set_defaults(func=cmd_info)
