"""Finished cells of a long benchmark, kept so that the same command run again continues where it
stopped: a benchmark made of many independent measurements (an accuracy table: one training run
per task, scheme, pooling and learning rate) asks ``Cells.run(key, fn)`` for each; a cell finished
by an earlier run of the same configuration is read back instead of being run again.

A cell's result is one JSON file under ``$HMI_HOME/runs/<benchmark>/<config hash>/``, written
atomically when the cell ends, so a run stopped at any point (Ctrl+C, a restart, a time limit)
loses at most the cell it was in.  The config hash covers everything that makes a result
comparable (root artifact, data sizes, epochs, code format): another configuration starts afresh
and leaves this one's cells alone.

A home can be lost between runs (another machine, a wiped disk), and a table of 12-layer runs
takes longer than one machine is kept. So a benchmark may also keep its finished cells in a
*record* that travels with the project: one JSON-lines file per configuration,
``<record_dir>/<benchmark>-<config hash>.jsonl`` (the benchmarks pass ``docs/results/cells/``, beside
their results pages), its first line the configuration, then one line per finished cell (with the machine that ran it). A cell
is read back from the home or from the record; every cell a run finishes or reads back from its
home is added to the record (rewritten atomically), so the same command on a fresh home, with
the record committed, continues where the table stopped.

A cell that does not depend on everything its configuration names (an accuracy table's columns that
never read the root's windows are the same for every calibrated artifact of that root) may also be
read back from the records of other configurations: ``adopt(config, key)`` says which cells of a
record of configuration ``config`` are this one's; such a cell joins this configuration's record,
with the machine that ran it.

What several cells read and is long to make (a distilled column's teacher answers) is kept the same
way, in the home only (``Cells.tensors``): a run continued after a stop reads it back instead of
training the teacher again.

``max_minutes`` limits one invocation, not the recipe: a cell starts only while the invocation's
elapsed time is under it, so every invocation finishes at least one cell and the next invocation
of the same command continues after it."""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import machine
from hmi.home import hmi_home
from hmi.io import atomic_write_json, atomic_write_text, atomic_write_with
from hmi.timelimit import OutOfTime, TimeLimit


def digest(obj) -> str:
    """A short, stable hash of a JSON-able object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_record(path: Path) -> tuple[dict | None, dict[str, dict]]:
    """A record's configuration (None where its first line names none) and its cells by key digest,
    of the lines that read whole (a line cut short by a crash is left out)."""
    try:
        text = path.read_text()
    except OSError:
        return None, {}
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    if not lines or not isinstance(lines[0], dict) or not isinstance(lines[0].get("config"), dict):
        return None, {}
    return lines[0]["config"], {digest(c["key"]): c for c in lines[1:]
                                if isinstance(c, dict) and {"key", "result"} <= set(c)}


class Cells:
    def __init__(self, benchmark: str, config: dict, max_minutes: float | None = None, fresh: bool = False,
                 home: Path | None = None, record_dir: Path | None = None, train: bool = True,
                 adopt: Callable[[dict, dict], bool] | None = None):
        self.config, config_hash = config, digest(config)
        self.folder = (home or hmi_home()) / "runs" / benchmark / config_hash
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / "config.json", config)
        self.record = None if record_dir is None else record_dir / f"{benchmark}-{config_hash}.jsonl"
        if fresh:
            for f in self.folder.glob("cell-*.json"):
                f.unlink()
            if self.record is not None:
                self.record.unlink(missing_ok=True)
        self.recorded = self._read_record()
        self.adopted = self._read_others(benchmark, adopt) if adopt is not None and self.record is not None else {}
        self.limit = TimeLimit(max_minutes)
        self.train = train  # False: cells are read back, none is run (``work`` raises OutOfTime)
        self.reused = self.ran = 0

    def _path(self, key: dict) -> Path:
        return self.folder / f"cell-{digest(key)}.json"

    def _read_record(self) -> dict[str, dict]:
        """The record's cells by key digest: those of this configuration whose lines read whole
        (a record of another configuration, or a line cut short, is not read)."""
        config, cells = read_record(self.record) if self.record is not None else (None, {})
        return cells if config is not None and digest(config) == digest(self.config) else {}

    def _read_others(self, benchmark: str, adopt: Callable[[dict, dict], bool]) -> dict[str, dict]:
        """The cells of other configurations' records of ``benchmark`` that ``adopt(config, key)``
        accepts, by key digest (the first record in name order wins)."""
        out: dict[str, dict] = {}
        for path in sorted(self.record.parent.glob(f"{benchmark}-*.jsonl")):
            config, cells = read_record(path) if path != self.record else (None, {})
            for k, c in cells.items():
                if config is not None and adopt(config, c["key"]):
                    out.setdefault(k, c)
        return out

    def _kept(self, key: dict) -> dict | None:
        """Cell ``key`` as kept in the home, else in the record, else among the adopted ones (None
        when in none or unreadable)."""
        try:
            stored = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            stored = self.recorded.get(digest(key)) or self.adopted.get(digest(key))
        return stored if isinstance(stored, dict) and stored.get("key") == key else None

    def run(self, key: dict, fn: Callable[[], dict]) -> dict:
        """Cell ``key``'s result: read back when finished before, else ``fn()`` (a JSON-able dict),
        kept once it returns. Raises ``OutOfTime`` instead of starting a cell past ``max_minutes``."""
        stored = self._kept(key)
        if stored is not None:
            self.reused += 1
            self._add_to_record(stored)
            return stored["result"]
        t0 = time.monotonic()
        result = self.work(fn)
        stored = {"key": key, "result": result, "seconds": round(time.monotonic() - t0, 1), "machine": machine()}
        atomic_write_json(self._path(key), stored)
        self._add_to_record(stored)
        return result

    def tensors(self, key: dict, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Tensors that several cells read (a distilled column's teacher answers), ``key``'s: read
        back from the home where an earlier run kept them, else ``compute()``, kept atomically.
        Kept in the home only, not in the record: the cells that read them are recorded."""
        path, named = self.folder / f"tensors-{digest(key)}.pt", json.dumps(key, sort_keys=True, default=str)
        try:
            kept = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # not kept, or cut short: computed again
            kept = None
        if isinstance(kept, dict) and kept.get("key") == named:
            return kept["tensors"]
        out = compute()
        atomic_write_with(path, lambda f: torch.save({"key": named, "tensors": out}, f))
        return out

    def _add_to_record(self, cell: dict) -> None:
        if self.record is None or digest(cell["key"]) in self.recorded:
            return
        self.recorded[digest(cell["key"])] = cell
        self.record.parent.mkdir(parents=True, exist_ok=True)
        lines = [{"config": self.config}, *self.recorded.values()]
        atomic_write_text(self.record, "".join(json.dumps(c, sort_keys=True) + "\n" for c in lines))

    def work(self, fn: Callable[[], object]):
        """``fn()``, under the limit of ``run``: a unit of work that keeps its own result (a
        checkpointed job, a published branch). Raises ``OutOfTime`` instead of starting it past
        ``max_minutes`` once this invocation has done some work, or at once where it trains nothing."""
        if not self.train:
            raise OutOfTime("this invocation trains nothing")
        if self.ran and self.limit.spent():
            raise OutOfTime(f"{self.limit.minutes:g} minutes spent")
        out = fn()
        self.ran += 1
        return out

    def summary(self) -> str:
        return (f"{self.ran} cell(s) run, {self.reused} reused from earlier runs "
                f"(kept in {self.folder}" + (f" and recorded in {self.record})" if self.record else ")"))
