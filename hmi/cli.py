"""The ``hmi`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging

    logging.set_verbosity_error()


def held_out_texts(n: int = 256) -> list[str]:
    """Real text never used for calibration: test texts of the four text tasks, in turn."""
    from hmi.data import load_task

    per = [load_task(t, "test", n) for t in ("news-topic", "review-sentiment", "tweet-sentiment", "license-category")]
    out = []
    for i in range(n):
        for rows in per:
            if i < len(rows) and len(out) < n:
                out.append(rows[i]["text"])
    return out


def cmd_data_prepare(args) -> int:
    from hmi.data import data_dir
    from hmi.data.prepare import prepare

    out = Path(args.out) if args.out else data_dir()
    stats = prepare(out, force=args.force)
    for name, s in stats["tasks"].items():
        print(f"task {name:18s} " + "  ".join(f"{p}={s[p]['n']}" for p in ("train", "dev", "test")))
    for name, s in stats["corpora"].items():
        print(f"corpus {name:12s} lines={s['lines']:7d} chars={s['chars']:9d}")
    return 0


def ensure_data() -> None:
    from hmi.data import data_dir
    from hmi.data.prepare import prepare

    if not (data_dir() / "stats.json").exists():
        prepare(data_dir())


def cmd_calibrate(args) -> int:
    _quiet_transformers()
    import torch

    from hmi.data import load_corpus
    from hmi.model.artifact import uncalibrated_root
    from hmi.model.calibrate import CalibrationConfig, calibrate
    from hmi.model.root import default_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_data()
    cfg = CalibrationConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                            max_minutes=args.max_minutes)
    root = uncalibrated_root(default_spec(args.l_low))
    artifact_id, meta = calibrate(root, load_corpus("general"), held_out_texts(args.eval_texts), cfg)
    print(f"root artifact {artifact_id}")
    print_quality(meta)
    return 0


def print_quality(meta: dict) -> None:
    q = meta.get("quality")
    if not q:
        return
    print(f"{'held-out real text':30s} {'before':>8s} {'after':>8s}")
    for key, name in (("lower_cosine", "cosine at layer L_low (token)"), ("pooled_cosine", "cosine of pooled output")):
        print(f"{name:30s} {q['before'][key]:8.4f} {q['after'][key]:8.4f}")


def cmd_info(args) -> int:
    from hmi.home import hmi_home
    from hmi.model.artifact import artifact_config, current_artifact_id

    home = hmi_home()
    aid = current_artifact_id()
    print(f"HMI home: {home}")
    if aid is None:
        print("root artifact: none (run `hmi calibrate`)")
        return 0
    meta = artifact_config(aid)
    print(f"root artifact: {aid}  root={meta['root']}  L_low={meta['l_low']}  hidden={meta['hidden_size']}")
    cal = meta.get("calibration", {})
    print(f"calibration: steps={cal.get('steps_done')} batch={cal.get('batch_size')} lr={cal.get('lr')} "
          f"seconds(last run)={cal.get('train_seconds_this_run')}")
    print_quality(meta)
    if args.json:
        print(json.dumps(meta, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hmi", description="HMI: hierarchical multi-tenant inference server")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="real datasets and domain corpora").add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="fetch, normalize and split every task and corpus")
    prep.add_argument("--out", help="output folder (default: HMI_DATA_DIR or data/cache)")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.set_defaults(func=cmd_data_prepare)

    cal = sub.add_parser("calibrate", help="distill the windowed lower layers from the full root")
    cal.add_argument("--steps", type=int, default=300)
    cal.add_argument("--batch-size", type=int, default=32)
    cal.add_argument("--lr", type=float, default=2e-4)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--l-low", type=int, default=3)
    cal.add_argument("--max-minutes", type=float, default=None, help="stop early after this many minutes")
    cal.add_argument("--eval-texts", type=int, default=256)
    cal.add_argument("--threads", type=int, default=0)
    cal.set_defaults(func=cmd_calibrate)

    info = sub.add_parser("info", help="home directory, root artifact and its quality figures")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
