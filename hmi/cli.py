"""The ``hmi`` command line: argparse and printing only (nothing imports it).

Light modules (data, home, client, allocator) are imported here; a command imports the model
side (torch, transformers, the PLOT) when it runs, so that ``hmi --help`` and the HTTP client
commands start in a fraction of a second."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hmi.adapters.spec import HEAD_DEFAULTS, KIND_OPTIONS, KINDS, AdapterSpec, misplaced_option
from hmi.allocator import tune_allocator
from hmi.archive import zip_folder
from hmi.bootstrap import calibrate_default, check_shipped, ensure_data, prepare_default
from hmi.bootstrap import quiet_transformers as _quiet_transformers
from hmi.client import ApiError, Client, load_rows
from hmi.data import CORPORA, data_dir, held_out_texts, load_corpus, task_labels
from hmi.data.prepare import prepare
from hmi.home import hmi_home
from hmi.model.aliases import ALIASES, DEFAULT_L_LOW, DEFAULT_ROOT, RootError, default_l_low, pointer_name, source_of
from hmi.version_tree.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, steps_help


def cmd_data_prepare(args) -> int:
    out = Path(args.out) if args.out else data_dir()
    stats = prepare(out, force=args.force)
    for name, s in stats["tasks"].items():
        print(f"task {name:18s} " + "  ".join(f"{p}={s[p]['n']}" for p in ("train", "dev", "test")))
    for name, s in stats["corpora"].items():
        print(f"corpus {name:12s} lines={s['lines']:7d} chars={s['chars']:9d}")
    return 0


def cmd_calibrate_decoder(args) -> int:
    from hmi.training.calibrate_decoder import DecoderCalibrationConfig, calibrate_and_save

    cfg = DecoderCalibrationConfig(steps=args.steps or DecoderCalibrationConfig.steps)
    root, meta = calibrate_and_save(hmi_home(), args.l_low or 2, cfg)
    q = meta["quality"]
    print(f"decoder root {root.artifact_id}: perplexity on {q['eval_texts']} held-out texts: full model {q['ppl_full']}, "
          f"naive windows {q['ppl_naive_window']}, calibrated windows {q['ppl_calibrated']} "
          f"({meta['train_seconds']} s of training)")
    return 0


def cmd_calibrate(args) -> int:
    # Options left out keep CalibrationConfig's defaults, stated there only.
    given = {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "max_minutes") if getattr(args, k) is not None}
    for k, v in given.items():
        if not v > 0:
            raise SystemExit(f"hmi calibrate: --{k.replace('_', '-')} must be positive, got {v}")
    _quiet_transformers()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_data()
    if args.decoder:
        return cmd_calibrate_decoder(args)
    if args.check_shipped:
        if given or args.seed or not args.backoff or args.eval_texts != 256 or args.root != DEFAULT_ROOT:
            raise SystemExit("hmi calibrate --check-shipped: the shipped artifact is reproduced with the defaults only")
        shipped, made = check_shipped(args.l_low or DEFAULT_L_LOW)
        print(f"shipped: {shipped or 'none for this root and split'}\ncalibrated now: {made}")
        print("identical, bit for bit" if shipped == made else "different")
        return 0 if shipped == made else 1
    artifact_id, meta = calibrate_default(args.l_low, args.seed, args.backoff, args.eval_texts, root=args.root, **given)
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
    from hmi.model.artifact import artifact_config, calibration_shortfall, current_artifact_id

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
    if args.json:
        print(json.dumps(meta, indent=1))
    return 0


def parse_selection(text: str):
    from hmi.plot.build import Selection

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


def read_corpus_arg(corpus: str) -> list[str]:
    if corpus in CORPORA:
        ensure_data()
        return load_corpus(corpus)
    path = Path(corpus)
    if not path.exists():
        raise SystemExit(f"hmi: corpus {corpus!r} is neither a prepared corpus ({', '.join(CORPORA)}) nor a file")
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]


def load_current_root(root: str = DEFAULT_ROOT, l_low: int | None = None):
    _quiet_transformers()
    from hmi.model.artifact import ArtifactMissingError, load_root
    from hmi.model.catalog import root_spec

    try:
        return load_root(spec=root_spec(root, l_low))
    except ArtifactMissingError as exc:
        raise SystemExit(f"hmi: {exc}")


def cmd_plot_build(args) -> int:
    from hmi.plot.build import build_from_corpus
    from hmi.plot.paths import plot_meta, root_plot_path
    from hmi.plot.store import PlotStore

    sel = parse_selection(args.select)
    lines = read_corpus_arg(args.corpus)
    if args.decoder:
        from hmi.training.calibrate_decoder import load_calibrated_decoder

        root = load_calibrated_decoder(hmi_home())
        if root is None:
            raise SystemExit("hmi: no calibrated decoder root yet; run `hmi calibrate --decoder` first")
    else:
        root = load_current_root(args.root, args.l_low)
    out = Path(args.out) if args.out else root_plot_path(root)
    store = PlotStore(out, meta=plot_meta(root), readonly=False)
    try:
        summary = build_from_corpus(store, root.plot_lower, root.tokenizer, lines, sel, max_len=args.max_len)
    finally:
        store.close()
    if summary.get("up_to_date"):
        print(f"PLOT at {out} is already complete ({summary['entries']} entries)")
    else:
        print(f"PLOT at {out}: {summary['entries']} entries, {summary['file_bytes'] / 2**20:.1f} MiB on disk, "
              f"{summary['written']} computed in {summary['seconds']} s ({summary['ngrams_per_s']} n-grams/s), "
              f"selection {summary['selection']}, {summary['distinct_trigrams']} distinct corpus tri-grams")
    return 0


def cmd_plot_stats(args) -> int:
    from hmi.plot.store import PlotStore

    store = PlotStore(args.path, readonly=True)
    print(json.dumps({"meta": store.meta.__dict__, "stats": store.stats(), "build": store.get_record("build")},
                     indent=1))
    return 0


def cmd_prepare(args) -> int:
    """Data, calibrated root and root PLOT of the embedded default, each only when missing."""
    _quiet_transformers()
    root = prepare_default(hmi_home(), args.root, args.l_low)
    print(f"ready: root {root.artifact_id} and its root PLOT in {hmi_home()}")
    return 0


def cmd_demo(args) -> int:
    """Set-up of the embedded default and a look at what it computes."""
    _quiet_transformers()
    import torch

    from hmi.plot.lookup import PlotLookup
    from hmi.plot.paths import open_root_version

    root = prepare_default(hmi_home())
    print(f"root artifact {root.artifact_id}")
    print_quality(root.meta)
    lookup = PlotLookup([open_root_version(root)], policy="compute")
    texts = held_out_texts(8)
    enc = root.tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    from hmi.model.root import full_forward, mean_pool

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


def cmd_serve(args) -> int:
    _quiet_transformers()
    from hmi.dispatcher.serve import serve
    from hmi.dispatcher.server import ServerConfig, ServerConfigError
    from hmi.scheduler.pipeline import pick_device

    try:
        pick_device(args.device)
        if not 8 <= args.max_len <= 512:  # the position limit of both packaged roots; the server checks its own
            raise ValueError(f"--max-len {args.max_len} is outside [8, 512]")
    except ValueError as exc:
        print(f"hmi serve: {exc}", file=sys.stderr)
        return 2
    cfg = ServerConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, pool_slots=args.pool_slots,
                       miss_policy=args.miss_policy, device=args.device, max_len=args.max_len)
    try:
        if args.ray:
            if args.hgpt:
                print("hmi serve: --hgpt is not served through --ray yet", file=sys.stderr)
                return 2
            if args.replicas < 1:
                print(f"hmi serve: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
                return 2
            if not args.registry_cache_s >= 0:
                print(f"hmi serve: --registry-cache-s must be 0 or more, got {args.registry_cache_s}", file=sys.stderr)
                return 2
            if not args.job_cpus > 0:
                print(f"hmi serve: --job-cpus must be above 0, got {args.job_cpus}", file=sys.stderr)
                return 2
            from hmi.scaleout.ray_serve import serve as serve_ray

            return serve_ray(args.host, args.port, not args.no_demo, cfg, args.replicas, args.tenants_per_replica,
                             root=args.root, l_low=args.l_low, ingress=args.ingress, job_cpus=args.job_cpus,
                             registry=args.registry, registry_cache_s=args.registry_cache_s)
        return serve(args.host, args.port, not args.no_demo, cfg, hgpt=args.hgpt, root=args.root, l_low=args.l_low)
    except ServerConfigError as exc:
        print(f"hmi serve: {exc}", file=sys.stderr)
        return 2


def _client(args):
    return Client(args.url, args.token)


def _print(obj) -> None:
    print(json.dumps(obj, indent=1))


def _run_client(fn):
    def wrapped(args) -> int:
        try:
            return fn(args) or 0
        except (ApiError, ConnectionError) as exc:
            print(f"hmi: {exc}", file=sys.stderr)
            return 1

    return wrapped


@_run_client
def cmd_infer(args):
    _print(_client(args).infer(args.tenant, args.texts, truncate=args.truncate))


@_run_client
def cmd_generate(args):
    body = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "seed": args.seed, "stop": args.stop}
    final = {}
    for msg in _client(args).generate_stream(args.tenant, {k: v for k, v in body.items() if v is not None}):
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


@_run_client
def cmd_tenant_create(args):
    data = None
    if args.train:
        data = {"train": load_rows(args.train), "dev": load_rows(args.dev) if args.dev else []}
    adapter = adapter_body(args)
    labels = args.labels.split(",") if args.labels else None
    if labels is None and args.dataset:
        labels = task_labels(args.dataset)
    if not labels:
        raise SystemExit("hmi: give --labels (comma-separated) or --dataset")
    c = _client(args)
    out = c.create_tenant(args.name, labels, args.type, data, args.dataset, args.domain, adapter,
                          args.max_train, args.epochs, pooling=args.pooling, truncate=args.truncate)
    _print(out)
    if args.wait:
        _print(c.wait_job(out["job"]))


@_run_client
def cmd_tenant_import(args):
    path = Path(args.archive)
    data = zip_folder(path) if path.is_dir() else path.read_bytes()
    _print(_client(args).import_adapter(args.name, data, model=args.model))


@_run_client
def cmd_tenant_export(args):
    data = _client(args).export_adapter(args.name)
    out = Path(args.out or f"{args.name}-adapter.zip")
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes)")


@_run_client
def cmd_tenant_update(args):
    data = {"train": load_rows(args.train), "dev": load_rows(args.dev) if args.dev else []} if args.train else None
    c = _client(args)
    out = c.update_tenant(args.name, data, args.dataset, args.max_train, args.epochs)
    _print(out)
    if args.wait:
        _print(c.wait_job(out["job"]))


@_run_client
def cmd_tenant_delete(args):
    _print(_client(args).delete_tenant(args.name))


@_run_client
def cmd_tenant_list(args):
    for t in _client(args).tenants():
        acc = ((t.get("metrics") or {}).get("test") or {}).get("accuracy")
        print(f"{t['name']:24s} {t['state']:10s} {t['spec']['kind']:10s} {t['spec']['head']:14s} "
              f"labels={len(t['spec']['labels'])} test_acc={acc}")


@_run_client
def cmd_jobs(args):
    c = _client(args)
    if args.cancel:
        _print(c.cancel_job(args.cancel))
        return
    for j in c.jobs():
        print(f"{j['id']}  {j['kind']:7s} {j['tenant']:24s} {j['state']:10s} progress={j.get('progress')}"
              + (f"  error={j['error']}" if j.get("error") else ""))


def _tree():
    from hmi.version_tree.tree import VersionTree

    return VersionTree(load_current_root())


def _domain_error(fn):
    def wrapped(args) -> int:
        from hmi.version_tree.tree import DomainError

        try:
            return fn(args) or 0
        except DomainError as exc:
            print(f"hmi: {exc}", file=sys.stderr)
            return 2

    return wrapped


def _domain_via_server(args) -> bool:
    return bool(getattr(args, "url", None))


def _fpt_config(args):
    from hmi.version_tree.fpt import FPTConfig

    return FPTConfig(steps=args.steps, objective=args.objective or DEFAULT_OBJECTIVE)


@_domain_error
def cmd_domain_create(args):
    from hmi.version_tree.fpt import summary as fpt_summary

    if _domain_via_server(args):
        return _domain_client(args, "create")

    node = _tree().create(args.name, args.parent, read_corpus_arg(args.corpus), args.alpha,
                          _fpt_config(args))
    print(f"domain {node.name}: parent {node.parent}, {node.plot['entries']} PLOT entries, its tri-grams covering "
          f"{node.corpus['covered_occurrences']:.1%} of tri-gram occurrences; {fpt_summary(node.fpt)}")


@_run_client
def _domain_client(args, verb):
    c = _client(args)
    if verb == "delete":
        _print(c.delete_domain(args.name))
        return
    named = args.corpus in CORPORA and not Path(args.corpus).exists()
    corpus = None if named else [x.strip() for x in Path(args.corpus).read_text().splitlines() if x.strip()]
    kw = {"corpus": corpus, "corpus_name": args.corpus if named else None, "steps": args.steps,
          "objective": args.objective}
    out = c.create_domain(args.name, args.parent, alpha=args.alpha, **kw) if verb == "create" else \
        c.update_domain(args.name, **kw)
    _print(out)
    if args.wait:
        _print(c.wait_job(out["job"], timeout=7200))


@_domain_error
def cmd_domain_update(args):
    from hmi.version_tree.fpt import summary as fpt_summary

    if _domain_via_server(args):
        return _domain_client(args, "update")

    node = _tree().update(args.name, read_corpus_arg(args.corpus), _fpt_config(args))
    print(f"domain {node.name} updated: {node.corpus['lines']} corpus lines, {node.plot['entries']} PLOT entries; "
          f"{fpt_summary(node.fpt)}")


@_domain_error
def cmd_domain_delete(args):
    from hmi.dispatcher.registry import Registry
    if _domain_via_server(args):
        return _domain_client(args, "delete")

    in_use = set()
    reg_path = hmi_home() / "registry"
    if reg_path.exists():
        reg = Registry(reg_path)
        in_use = {r.get("domain") for _, r in reg.items("tenants")}
        reg.close()
    _tree().delete(args.name, in_use)
    print(f"domain {args.name} deleted")


@_run_client
def _domain_list_client(args):
    for d in _client(args).domains():
        print(f"{'  ' * d.get('depth', 0)}{d['name']}  tenants={d.get('tenants')} "
              f"entries={(d.get('plot') or {}).get('entries')}")


def cmd_domain_list(args):
    if _domain_via_server(args):
        return _domain_list_client(args)
    from hmi.version_tree.fpt import summary as fpt_summary

    for d in _tree().listing():
        if d["name"] == "root":
            print("root")
            continue
        print(f"{'  ' * d['depth']}{d['name']}  alpha={d['alpha']} entries={d['plot'].get('entries')} "
              f"bytes={d['bytes']} corpus_lines={d['corpus'].get('lines')} "
              f"{fpt_summary(d['fpt'])}")
    return 0


def add_root_options(parser) -> None:
    parser.add_argument("--root", default=DEFAULT_ROOT,
                        help=f"an alias ({', '.join(ALIASES)}; default {DEFAULT_ROOT}) or a BERT/RoBERTa/MPNet "
                             "checkpoint folder (converted once into HMI_HOME)")
    parser.add_argument("--l-low", type=int, default=None,
                        help="how many lower layers become PLOT lookups (default: half the root's layers)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hmi", description="HMI: hierarchical multi-tenant inference server")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="real datasets and domain corpora").add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="fetch, normalize and split every task and corpus")
    prep.add_argument("--out", help="output folder (default: HMI_DATA_DIR or data/cache)")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.set_defaults(func=cmd_data_prepare)

    cal = sub.add_parser("calibrate", help="distill the windowed lower layers from the full root")
    cal.add_argument("--decoder", action="store_true", help="calibrate the hGPT decoder root (SmolLM2-135M) instead")
    cal.add_argument("--steps", type=int, default=None, help="default 600 (encoder; 800 for mpnet-base), 150 (decoder)")
    cal.add_argument("--batch-size", type=int, default=None, help="default 32 (encoder)")
    cal.add_argument("--lr", type=float, default=None, help="default 5e-4 (encoder; 3e-4 for mpnet-base)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--root", default=DEFAULT_ROOT,
                     help=f"an alias ({', '.join(ALIASES)}; default {DEFAULT_ROOT}) or a BERT/RoBERTa/MPNet checkpoint folder")
    cal.add_argument("--l-low", type=int, default=None,
                     help="lower layers: default half the root's (3 of 6, 6 of 12); decoder: 2 of 30")
    cal.add_argument("--max-minutes", type=float, default=None,
                     help="the encoder calibration's time budget, resumed runs included (default 30; 90 for "
                          "mpnet-base); the learning rate decays over the budget when the steps would not fit")
    cal.add_argument("--eval-texts", type=int, default=256)
    cal.add_argument("--threads", type=int, default=0)
    cal.add_argument("--no-backoff", dest="backoff", action="store_false",
                     help="train every window computed, not as the PLOT serves text (windows it misses back off)")
    cal.add_argument("--check-shipped", action="store_true",
                     help="calibrate with the defaults in a throw-away home and compare with the artifact shipped "
                          "in the package (same CPU kind, torch and thread count: identical bit for bit)")
    cal.set_defaults(func=cmd_calibrate)

    plot = sub.add_parser("plot", help="PLOT lookup tables").add_subparsers(dest="plot_cmd", required=True)
    pb = plot.add_parser("build", help="build (or resume) a PLOT from a corpus")
    pb.add_argument("--corpus", default="general", help="a prepared corpus name or a text file (one line each)")
    pb.add_argument("--out", help="LMDB folder (default: the current root's root PLOT)")
    pb.add_argument("--select", default="all", help="all, alpha:A (coverage) or top_k:K")
    pb.add_argument("--max-len", type=int, default=128)
    pb.add_argument("--decoder", action="store_true", help="a causal PLOT of the calibrated hGPT decoder root")
    add_root_options(pb)
    pb.set_defaults(func=cmd_plot_build)
    ps = plot.add_parser("stats", help="entries and bytes of a PLOT")
    ps.add_argument("path")
    ps.set_defaults(func=cmd_plot_stats)

    prep_all = sub.add_parser("prepare", help="data, calibrated root and root PLOT, each only when missing")
    add_root_options(prep_all)
    prep_all.set_defaults(func=cmd_prepare)

    demo = sub.add_parser("demo", help="set up the embedded default and encode held-out texts through it")
    demo.set_defaults(func=cmd_demo)

    srv = sub.add_parser("serve", help="run the HTTP server (prepares the embedded default when missing)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--no-demo", action="store_true", help="do not create the demo tenants")
    add_root_options(srv)
    srv.add_argument("--max-batch", type=int, default=32)
    srv.add_argument("--max-wait-ms", type=float, default=5.0)
    srv.add_argument("--pool-slots", type=int, default=64)
    srv.add_argument("--max-len", type=int, default=128,
                     help="tokens of a text the encoder tenants read (up to the root's position limit, 512 for both "
                          "roots); longer texts are refused or, for tenants that truncate, cut (docs/bench_limits.md "
                          "measures the cost)")
    srv.add_argument("--miss-policy", default="backoff", choices=["backoff", "compute"],
                     help="backoff (fast, the paper's) or compute (exact windowed layers on misses)")
    srv.add_argument("--hgpt", action="store_true",
                     help="also serve decoder tenants (SmolLM2-135M; builds its causal PLOT on first start)")
    srv.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where the upper layers, adapter pools and KV cache run (auto: cuda when torch sees a GPU)")
    srv.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: replicas of this server sharing HMI_HOME, requests routed to the "
                          "replica that holds their tenant (needs the ray extra: pip install -e '.[ray]'; RAY_ADDRESS "
                          "names a running cluster, else a local one is started)")
    srv.add_argument("--replicas", type=int, default=2, help="with --ray: serving replicas (default 2)")
    srv.add_argument("--tenants-per-replica", type=int, default=1000,
                     help="with --ray: tenants a replica holds before Ray Serve's LRU lets one go (default 1000)")
    srv.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                     help="with --ray, for the local cluster it starts: Ray Serve's HAProxy ingress, straight to the "
                          "replicas with a tenant kept on one replica by a hash of its routing header (default), or "
                          "its Python HTTP proxy, routing by the replicas' multiplexed LRUs")
    srv.add_argument("--job-cpus", type=float, default=1.0,
                     help="with --ray: CPUs a fine-tune or domain job's Ray task reserves; jobs run on whichever node "
                          "has them free (default 1)")
    srv.add_argument("--registry", choices=["home", "actor"], default="home",
                     help="with --ray: the registry the replicas share: HMI_HOME's own LMDB (replicas on one machine; "
                          "default) or a Ray actor owning it on this node (replicas on several machines, HMI_HOME on a "
                          "shared file system)")
    srv.add_argument("--registry-cache-s", type=float, default=0.0,
                     help="with --registry actor: seconds a replica keeps a tenant's record (a change made through "
                          "another replica is then seen within this; 0, the default: at once, one actor call per request)")
    srv.set_defaults(func=cmd_serve)

    def client_args(p):
        p.add_argument("--url", default=os.environ.get("HMI_URL", "http://127.0.0.1:8080"))
        p.add_argument("--token", default=None, help="default: HMI_TOKEN, HMI_ADMIN_TOKEN or $HMI_HOME/admin_token")
        return p

    gen = client_args(sub.add_parser("generate", help="generate text with a decoder tenant (streams as it comes)"))
    gen.add_argument("tenant")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    inf = client_args(sub.add_parser("infer", help="run a tenant's model on texts (through the server)"))
    inf.add_argument("tenant")
    inf.add_argument("texts", nargs="+")
    inf.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=None,
                     help="cut texts over the server's token limit (default: the tenant's setting)")
    inf.set_defaults(func=cmd_infer)

    ten = sub.add_parser("tenant", help="tenant hPLMs on a server").add_subparsers(dest="tenant_cmd", required=True)
    tc = client_args(ten.add_parser("create", help="create a tenant (starts a fine-tune job)"))
    tc.add_argument("name")
    tc.add_argument("--dataset", help="a prepared task (e.g. news-topic) as training data")
    tc.add_argument("--train", help="JSON Lines of {text,label} or {tokens,tags}")
    tc.add_argument("--dev", help="JSON Lines for early stopping")
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
                    help="what a classification head reads: the [CLS] vector (default) or the mean of the tokens")
    tc.add_argument("--domain", default="root")
    tc.add_argument("--max-train", type=int)
    tc.add_argument("--epochs", type=int)
    tc.add_argument("--truncate", action="store_true",
                    help="cut texts over the server's token limit in training and inference (default: refuse them)")
    tc.add_argument("--wait", action="store_true", help="wait for the job and print it")
    tc.set_defaults(func=cmd_tenant_create)
    ti = client_args(ten.add_parser("import", help="bring your own adapter: upload an adapters-library folder (or PEFT "
                                    "LoRA folder with --model decoder), as a folder or a zip"))
    ti.add_argument("name")
    ti.add_argument("archive", help="the saved folder, or a zip of it")
    ti.add_argument("--model", default="encoder", choices=["encoder", "decoder"], help="the kind of a new tenant")
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
    tu.add_argument("--wait", action="store_true")
    tu.set_defaults(func=cmd_tenant_update)
    td = client_args(ten.add_parser("delete", help="delete a tenant"))
    td.add_argument("name")
    td.set_defaults(func=cmd_tenant_delete)
    tl = client_args(ten.add_parser("list", help="list tenants"))
    tl.set_defaults(func=cmd_tenant_list)

    jobs = client_args(sub.add_parser("jobs", help="list jobs, or cancel one"))
    jobs.add_argument("--cancel", metavar="JOB_ID")
    jobs.set_defaults(func=cmd_jobs)

    dom = sub.add_parser("domain", help="the version tree of domains (in HMI_HOME, or on a server with --url)"
                         ).add_subparsers(dest="domain_cmd", required=True)

    def server_args(p):
        p.add_argument("--url", default=None, help="act through this server instead of on HMI_HOME directly")
        p.add_argument("--token", default=None)
        return p

    dc = server_args(dom.add_parser("create", help="branch a domain: further-pretrain the lower layers, build a pruned PLOT"))
    dc.add_argument("--wait", action="store_true", help="with --url: wait for the job")
    dc.add_argument("name")
    dc.add_argument("--parent", default="root")
    dc.add_argument("--corpus", required=True, help="a prepared corpus name (e.g. legal) or a text file")
    dc.add_argument("--alpha", type=float, default=0.5, help="share of tri-gram occurrences the PLOT covers")
    dc.add_argument("--steps", type=int, default=None, help=f"further-pretraining steps (default: {steps_help()})")
    dc.add_argument("--objective", choices=OBJECTIVES, default=None,
                    help="further pretraining: distill the full root on the domain's text (default), or the paper's MLM")
    dc.set_defaults(func=cmd_domain_create)
    du = server_args(dom.add_parser("update", help="continue further pretraining on more corpus and refresh the PLOT"))
    du.add_argument("--wait", action="store_true", help="with --url: wait for the job")
    du.add_argument("name")
    du.add_argument("--corpus", required=True)
    du.add_argument("--steps", type=int, default=None, help=f"further-pretraining steps (default: {steps_help()})")
    du.add_argument("--objective", choices=OBJECTIVES, default=None)
    du.set_defaults(func=cmd_domain_update)
    dd = server_args(dom.add_parser("delete", help="delete a domain (refused while tenants use it)"))
    dd.add_argument("name")
    dd.set_defaults(func=cmd_domain_delete)
    dl = server_args(dom.add_parser("list", help="the domain tree with sizes"))
    dl.set_defaults(func=cmd_domain_list)

    info = sub.add_parser("info", help="home directory, root artifact and its quality figures")
    info.add_argument("--json", action="store_true")
    add_root_options(info)
    info.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        return args.func(args)
    except RootError as exc:  # an unknown root, a failed fetch, a checkpoint HMI cannot split
        print(f"hmi: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
