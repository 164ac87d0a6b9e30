"""What the command groups share: client options and calls, printing, corpus and example-file arguments,
root options."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hmi.bootstrap import ensure_data
from hmi.client import ApiError, Client, load_rows
from hmi.data import CORPORA, corpus_texts
from hmi.model.aliases import ALIASES, DEFAULT_ROOT


def client(args):
    return Client(args.url, args.token)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


class JobProgress:
    """A job followed by ``--wait``, on ``out`` (stderr): its state, per cent, stage and setting, the
    time since the command began waiting and an estimate of what is left (the pace since the job was
    first seen running).  On a terminal one line rewritten at every poll; otherwise a line at every
    change of state, stage or setting, and every ``every`` seconds."""

    def __init__(self, out, every: float = 30.0, clock=time.monotonic):
        self.out, self.tty, self.every, self.clock = out, out.isatty(), every, clock
        self.t0 = clock()
        self.first: tuple[float, float] | None = None  # (when, progress) the job was first seen running
        self.last: tuple | None = None
        self.last_at = -every
        self.width = 0

    def line(self, job: dict, now: float) -> str:
        p, info = job.get("progress") or 0.0, job.get("info") or {}
        if job["state"] == "running" and self.first is None:
            self.first = (now, p)
        parts = [f"job {job['id']}: {job['state']}"] + ([f"{100 * p:.0f}%"] if job["state"] == "running" else [])
        parts += [info["stage"]] if info.get("stage") else []
        parts += [f"setting {info['setting']} of {info['settings']}"] if info.get("settings") else []
        parts.append(f"{_duration(now - self.t0)} waited")
        if job["state"] == "running" and self.first is not None and p > self.first[1]:
            parts.append(f"about {_duration((now - self.first[0]) * (1 - p) / (p - self.first[1]))} left")
        return ", ".join(parts)

    def update(self, job: dict) -> None:
        now = self.clock()
        text, info = self.line(job, now), job.get("info") or {}
        if self.tty:
            self.out.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            key = (job["state"], info.get("stage"), info.get("setting"))
            if key == self.last and now - self.last_at < self.every:
                return
            self.last, self.last_at = key, now
            self.out.write(text + "\n")
        self.out.flush()

    def end(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()


def wait_for_job(c: Client, job_id: str) -> int:
    """``--wait``: follows the job until it ends (``JobProgress`` on stderr), then prints it; 0 when
    it succeeded, 1 when it failed or was cancelled.  Ctrl+C stops the waiting, not the job (130)."""
    progress = JobProgress(sys.stderr)
    try:
        job = c.wait_job(job_id, timeout=None, on_poll=progress.update)
    except KeyboardInterrupt:
        progress.end()
        print(f"hmi: stopped waiting; job {job_id} goes on (`hmi jobs` shows it, `hmi jobs --cancel {job_id}` "
              "cancels it)", file=sys.stderr)
        return 130
    progress.end()
    show(job)
    return 0 if job["state"] == "succeeded" else 1


def show(obj) -> None:
    print(json.dumps(obj, indent=1))


def run_client(fn):
    """A client command: an API or connection error is a message and exit code 1, not a traceback."""
    def wrapped(args, *more) -> int:
        try:
            return fn(args, *more) or 0
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
