"""What a tenant created from training rows alone gets: the fine-tune holding out a tenth of them
as its dev split (``"hold_out"``, ``hmi.data.hold_out``) against training on every row with
nothing to choose by (the default), and against the same with texts without labels beside the
rows (the lines of the task's domain corpus that a ``dataset`` job reads,
``hmi.data.job_unlabeled``), side by side, as a new user meets it; and, as the last way, what the
accuracy tables' tenants are given, through HTTP: the same rows, the task's own dev rows and the
unlabeled texts (``eval_accuracy.py``'s distilled column, served ``auto``).

A server on a temporary home sharing the prepared root (``hmi serve``'s defaults: distilled
fine-tunes, ``serving: auto``, the root's miss policy) answers real HTTP requests: per task, a
tenant of each way created from the same ``--train`` rows of its training split (no dev rows but in
the last way: up to ``--test`` rows of the task's dev split), then the
task's test texts (up to ``--test``) sent to each through ``/v1/tenants/{tenant}/infer``; the
table gives their test accuracy, what each job chose (pooling, learning rate, served on the
windows or whole) and how long it took.

Every (task, way) is a cell (``benchmarks.cells``): the same command continues a stopped run.

Usage: python benchmarks/eval_hold_out.py [--quick | --tiny] [--tasks news-topic,review-sentiment,tweet-sentiment]
                                          [--train 640] [--test 1000] [--max-minutes M]
(``--quick``: 160 training rows and 200 test texts per tenant; ``--tiny``: 40 and 20, a rehearsal.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cells import Cells  # noqa: E402
from benchmarks.common import DOCS, finish, start, table  # noqa: E402
from hmi.timelimit import EXIT_UNFINISHED, OutOfTime  # noqa: E402

# training_data.hold_out: a tenth of the rows, or 0; the last two ways also send training_data.unlabeled,
# the last one the task's dev rows too
WAYS = ("held out", "every row trains", "every row trains, with unlabeled texts",
        "with the task's dev rows and unlabeled texts")
TASKS = ["news-topic", "review-sentiment", "tweet-sentiment"]
BATCH = 64  # texts per infer request


def options(ap) -> None:
    ap.add_argument("--tasks", default=",".join(TASKS), help="classification tasks, comma-separated")
    ap.add_argument("--train", type=int, help="training rows per tenant (default: the accuracy tables' 640; "
                    "--quick 160, --tiny 40)")
    ap.add_argument("--test", type=int, help="test texts scored per tenant (default 1000; --quick 200, --tiny 20)")
    ap.add_argument("--max-minutes", type=float, help="start no cell after this many minutes (the next run goes on)")


def tenant_cell(admin, task: str, way: str, n_train: int, n_test: int) -> dict:
    """Creates the tenant of ``task`` the ``way`` says through HTTP, waits for its job, and scores
    its answers to the task's test texts."""
    from hmi.data import job_unlabeled, load_task, task_labels

    data = {"train": load_task(task, "train", n_train), "hold_out": n_train // 10 if way == WAYS[0] else 0}
    if way in WAYS[2:]:
        data["unlabeled"] = job_unlabeled({"dataset": task}, n_train)
    if way == WAYS[3]:
        data["dev"] = load_task(task, "dev", n_test)
    name = f"{task}-{WAYS.index(way)}"
    out = admin.create_tenant(name, task_labels(task), training_data=data, truncate=True)
    job = admin.wait_job(out["job"], timeout=None)
    if job["state"] != "succeeded":
        raise SystemExit(f"{name}: the fine-tune ended {job['state']}: {job.get('error')}")
    test = load_task(task, "test", n_test)
    answers = [a for i in range(0, len(test), BATCH)
               for a in admin.infer(name, [r["text"] for r in test[i:i + BATCH]], truncate=True)]
    m = job["metrics"]
    return {"test": round(100 * sum(a["label"] == r["label"] for a, r in zip(answers, test)) / len(test), 2),
            "n_test": len(test), "dev_held_out": m.get("dev_held_out", 0), "pooling": m["pooling"],
            "lr": m["config"]["lr"], "serving": m["serving"]["mode"], "teacher_dev": m["serving"].get("teacher_dev"),
            "windows_dev": m["serving"].get("windows_dev"), "job_seconds": m["seconds"],
            "miss_policy": m["miss_policy"]}


def first_setting(results: dict) -> str:
    """What the tenants that trained on every row without dev rows kept, in words ("the [CLS] vector, rate 0.003"):
    their one setting, read from the cells (several where tasks differ)."""
    kept = sorted({(r["pooling"], r["lr"]) for ways in results.values() for way, r in ways.items() if way in WAYS[1:3]})
    words = {"cls": "the [CLS] vector", "mean": "the mean of the tokens"}
    return "; ".join(f"{words.get(p, p)}, rate {lr}" for p, lr in kept)


def main() -> None:
    args = start(__doc__, options)
    import shutil

    from benchmarks.bench_latency import bench_home
    from hmi.client import Client
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.services.server import ServerConfig

    tasks = args.tasks.split(",")
    sizes = (40, 20) if args.tiny else (160, 200) if args.quick else (640, 1000)
    args.train, args.test = args.train or sizes[0], args.test or sizes[1]
    home, token, root, _ = bench_home("hmi-eval-hold-out-", 0)
    cfg = ServerConfig()
    config = {"format": 1, "root": root.spec.name, "l_low": root.spec.l_low, "root_artifact": root.artifact_id,
              "train": args.train, "test": args.test, "distil": cfg.distil, "serving": cfg.serving}
    cells = Cells("eval_hold_out", config, max_minutes=args.max_minutes, record_dir=DOCS / "cells")
    url, stop = run_in_thread(build_server(cfg, home=home, root=root))
    results: dict = {}
    try:
        admin = Client(url, token)
        for task in tasks:
            for way in WAYS:
                key = {"task": task, "way": way, "train": args.train}
                results.setdefault(task, {})[way] = cells.run(
                    key, lambda task=task, way=way: tenant_cell(admin, task, way, args.train, args.test))
                print(f"{task}, {way}: {results[task][way]}", flush=True)
    except OutOfTime as exc:
        print(f"stopped: {exc} ({cells.summary()}); run the same command again to continue", flush=True)
        sys.exit(EXIT_UNFINISHED)
    finally:
        stop()
        shutil.rmtree(home, ignore_errors=True)

    rows = [(task, way, f"{r['test']:.1f}", r["dev_held_out"], f"{r['pooling']}, {r['lr']}", r["serving"],
             "-" if r["teacher_dev"] is None else f"{r['teacher_dev']:.3f} / {r['windows_dev']:.3f}",
             f"{r['job_seconds']:.0f}") for task, ways in results.items() for way, r in ways.items()]
    average = {way: round(sum(results[t][way]["test"] for t in tasks) / len(tasks), 2) for way in WAYS}
    text = (table(rows, ("task", "fine-tune", "test accuracy", "dev rows held out", "kept (pooling, rate)",
                         "served", "dev: teacher / windows", "job seconds"))
            + "\n\nAverage test accuracy: " + ", ".join(f"{w} {a}" for w, a in average.items())
            + f". Each tenant: the first {args.train} rows of the task's training split, the server's "
            f"defaults (distil {cfg.distil}, serving {cfg.serving}), texts cut to the server's token limit; test "
            f"accuracy in % over up to {args.test} test texts answered through HTTP. Held out: a tenth of the rows "
            "(drawn with a fixed seed) is the dev split that chooses the teacher's and the served adapter's pooling, "
            "rate and epoch and auto's serving; every row trains: one setting (" + first_setting(results) + "), the "
            "last epoch, served on the windows; with unlabeled texts: the same, the teacher also answering the "
            "first lines of the task's domain corpus (four per training row, at most 2000; they hold no test text) "
            "for the served adapter to learn from; with the task's dev rows: the same unlabeled texts and the first "
            f"{args.test} rows of the task's dev split (what the accuracy tables' distilled tenants are given, "
            f"but for texts cut at the server's {cfg.max_len} tokens where the tables cut at 64), which choose as the "
            "held-out rows do. Job seconds: the job's metrics.seconds, with whatever ran beside it (a "
            "ratio within one run holds; the seconds themselves are the machine's of that moment).")
    command = ("python benchmarks/eval_hold_out.py" + (" --tiny" if args.tiny else " --quick" if args.quick else "")
               + (f" --tasks {args.tasks}" if tasks != TASKS else "")
               + (f" --train {args.train}" if args.train != sizes[0] else "")
               + (f" --test {args.test}" if args.test != sizes[1] else ""))
    finish("eval_hold_out", text, {"tasks": results, "average": average, **config}, command)


if __name__ == "__main__":
    main()
