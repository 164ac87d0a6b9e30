"""One LMDB environment per domain version: packed n-gram key -> the ``(n, H)`` representation in
the PLOT's value format (``hmi.plot.codec``: fp16 or int8 rows with scales, in one or more records).

Named databases: ``entries`` (the table), ``meta`` (JSON records: the metadata checked on open,
build progress, statistics) and ``kept`` (the entries serving computed and kept, not the build:
key -> their uses and when last used; ``hmi.plot.kept``).  Readers open read-only and many at
once; the writer grows the map when it fills.
"""

from __future__ import annotations

import json
import struct
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
import numpy as np

from hmi.io import disk_writes
from hmi.plot import codec
from hmi.plot.keys import from_bytes, ngram_order, to_bytes

INITIAL_MAP_SIZE = 1 << 30
KEPT_RECORD = struct.Struct(">QQ")  # a kept entry's uses, then the time it was last used (ms since the epoch)


class PlotMismatchError(RuntimeError):
    """The PLOT was built for another root (artifact, split or hidden size) than the one in use."""


class PlotMissingError(RuntimeError):
    """No PLOT at the given location."""


@dataclass(frozen=True)
class PlotMeta:
    """What a PLOT was built for; checked whenever it is opened for serving."""

    root_artifact: str
    l_low: int
    hidden_size: int
    dtype: str = "float16"  # the value format: float16 or int8 (hmi.plot.codec)
    n: int = 3
    kind: str = "encoder"  # or "causal"
    chunks: int = 1  # LMDB records per value (hmi.plot.codec.leaf_chunks)

    @property
    def value_bytes(self) -> int:
        return codec.value_bytes(self.dtype, self.n, self.hidden_size)

    def identity(self) -> dict:
        """What the values mean (the root and split they come from); the value format (``dtype``,
        ``chunks``) is how they are stored, which any reader decodes."""
        return {k: v for k, v in asdict(self).items() if k not in ("dtype", "chunks")}


class PlotStore:
    """A PLOT on disk. Contract: ``get_many`` may be called from many threads and processes at
    once; ``put_many`` from one writer at a time (LMDB serializes writers)."""

    def __init__(self, path: Path | str, meta: PlotMeta | None = None, readonly: bool = True,
                 expect: PlotMeta | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self._guard = MapGuard()
        if readonly and not (self.path / "data.mdb").exists():
            raise PlotMissingError(f"no PLOT at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=INITIAL_MAP_SIZE, max_dbs=4, readonly=readonly,
                             subdir=True, readahead=False, max_readers=256, lock=True)
        if not readonly:
            self._grow_to_fit()
        self._entries = self.env.open_db(b"entries", create=not readonly)
        self._meta = self.env.open_db(b"meta", create=not readonly)
        try:  # a PLOT no server has kept entries in, opened read-only, has none
            self._kept = self.env.open_db(b"kept", create=not readonly)
        except lmdb.NotFoundError:
            self._kept = None
        stored = self.get_record("plot")
        if stored is None:
            if meta is None:
                raise PlotMissingError(f"PLOT at {self.path} has no metadata record")
            self.put_record("plot", asdict(meta))
            stored = asdict(meta)
        self.meta = PlotMeta(**stored)  # an existing PLOT keeps its value format
        if meta is not None and self.meta.identity() != meta.identity():
            raise PlotMismatchError(f"PLOT at {self.path} holds {self.meta}, not {meta}")
        if expect is not None:
            self.check(expect)

    def check(self, expect: PlotMeta) -> None:
        """Refuses a PLOT built for another root: serving it would give wrong representations."""
        if self.meta.identity() != expect.identity():
            diffs = [f"{k}: PLOT has {getattr(self.meta, k)!r}, expected {getattr(expect, k)!r}"
                     for k in expect.identity() if getattr(self.meta, k) != getattr(expect, k)]
            raise PlotMismatchError(f"PLOT at {self.path} was built for another root ({'; '.join(diffs)}); "
                                    "rebuild it with `hmi plot build`")

    # -- records -------------------------------------------------------------------------------
    def get_record(self, name: str):
        with self._begin(db=self._meta) as txn:
            raw = txn.get(name.encode())
        return None if raw is None else json.loads(bytes(raw))

    def put_record(self, name: str, value) -> None:
        self._write(lambda txn: txn.put(name.encode(), json.dumps(value).encode(), db=self._meta))

    # -- entries -------------------------------------------------------------------------------
    def put_many(self, keys: np.ndarray, values: np.ndarray, records: dict | None = None) -> None:
        """Writes entries (and optional meta records) in one transaction: all or nothing.

        Shapes: keys (N,) uint64; values (N, n, H) float, stored in the PLOT's value format.
        """
        values = np.asarray(values)
        if values.shape[1:] != (self.meta.n, self.meta.hidden_size):
            raise ValueError(f"values of shape {values.shape[1:]}; this PLOT stores {(self.meta.n, self.meta.hidden_size)}")
        # Keys in order, each once (the last value of a repeated key wins): a build's keys come
        # in order beyond every stored key, and then LMDB appends them to packed pages.
        keys = np.asarray(keys, dtype=np.uint64)
        keys, last = np.unique(keys[::-1], return_index=True)
        raw = codec.encode(values[::-1][last], self.meta.dtype)
        c = self.meta.chunks
        size = -(-raw.shape[1] // c)
        parts = [raw[i, j * size:(j + 1) * size].tobytes() for i in range(len(keys)) for j in range(c)]
        items = list(zip(codec.chunk_keys(keys, c), parts))

        def write(txn):
            cursor = txn.cursor(db=self._entries)
            append = bool(items) and (not cursor.last() or bytes(cursor.key()) < items[0][0])
            cursor.putmulti(items, append=append)
            for name, value in (records or {}).items():
                txn.put(name.encode(), json.dumps(value).encode(), db=self._meta)

        self._write(write)

    def as_stored(self, values: np.ndarray) -> np.ndarray:
        """Values as this PLOT gives them back (its format's rounding). Shapes: (N, n, H) -> (N, n, H) float16."""
        return codec.decode(codec.encode(values, self.meta.dtype), self.meta.dtype, self.meta.n, self.meta.hidden_size)

    def get_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batched lookup in one read transaction.

        Shapes: keys (N,) uint64 -> values (N, n, H) float16 (zeros where missing), found (N,) bool.
        """
        m = self.meta
        if len(keys) == 0:
            return np.zeros((0, m.n, m.hidden_size), dtype=np.float16), np.zeros(0, dtype=bool)
        # One cursor call for all keys (the C side walks them); distinct sorted keys make the
        # found pairs, which come back in query order, easy to place.  A value's chunks are
        # written in one transaction: all of them are there, or none.
        uniq, inverse = np.unique(np.asarray(keys, dtype=np.uint64), return_inverse=True)
        with self._begin(db=self._entries, buffers=True) as txn:
            pairs = txn.cursor().getmulti(codec.chunk_keys(uniq, m.chunks))
            vals_u = np.zeros((len(uniq), m.n, m.hidden_size), dtype=np.float16)
            found_u = np.zeros(len(uniq), dtype=bool)
            if pairs:
                at = np.searchsorted(uniq, from_bytes([bytes(k[:8]) for k, _ in pairs[::m.chunks]]))
                raw = np.frombuffer(b"".join(v for _, v in pairs), dtype=np.uint8).reshape(len(at), -1)
                vals_u[at] = codec.decode(raw[:, :m.value_bytes], m.dtype, m.n, m.hidden_size)
                found_u[at] = True
        inverse = inverse.reshape(-1)
        return vals_u[inverse], found_u[inverse]

    # -- kept entries (hmi.plot.kept) ----------------------------------------------------------
    def update_kept(self, new_keys: np.ndarray, new_values: np.ndarray, new_uses: np.ndarray, used_keys: np.ndarray,
                    used_counts: np.ndarray, budget: int | None, low_water: float = 0.9, now_ms: int = 0) -> dict:
        """One write transaction of kept entries (all or nothing):

        - each of ``new_keys`` this PLOT does not hold yet (another process may have kept it, or
          a build written it) is written with its value and ``new_uses`` uses;
        - each of ``used_keys`` that is a kept entry gains ``used_counts`` uses (built entries
          are not counted: they are never removed);
        - past ``budget`` kept entries, the least used (the least recently used among equals) are
          removed until ``low_water`` of the budget remain: the most frequent windows stay.

        Shapes: new_keys (N,) uint64 distinct, new_values (N, n, H), new_uses (N,) int; used_keys
        (M,) uint64 distinct, used_counts (M,) int.  Returns ``{"added", "evicted", "kept"}``.
        """
        m = self.meta
        new_keys = np.asarray(new_keys, dtype=np.uint64)
        raw = codec.encode(np.asarray(new_values), m.dtype) if len(new_keys) else None
        size = -(-raw.shape[1] // m.chunks) if raw is not None else 0
        out = {"added": 0, "evicted": 0, "kept": 0}

        def write(txn):
            entries, chunk_keys = txn.cursor(db=self._entries), codec.chunk_keys(new_keys, m.chunks)
            for i, key in enumerate(to_bytes(new_keys)):
                if entries.set_key(chunk_keys[i * m.chunks]):
                    continue
                for j in range(m.chunks):
                    txn.put(chunk_keys[i * m.chunks + j], raw[i, j * size:(j + 1) * size].tobytes(), db=self._entries)
                txn.put(key, KEPT_RECORD.pack(int(new_uses[i]), now_ms), db=self._kept)
                out["added"] += 1
            for key, n in zip(to_bytes(np.asarray(used_keys, dtype=np.uint64)), used_counts):
                rec = txn.get(key, db=self._kept)
                if rec is not None:
                    txn.put(key, KEPT_RECORD.pack(KEPT_RECORD.unpack(rec)[0] + int(n), now_ms), db=self._kept)
            kept = txn.stat(self._kept)["entries"]
            if budget is not None and kept > budget:
                records = [(KEPT_RECORD.unpack(v), bytes(k)) for k, v in txn.cursor(db=self._kept).iternext()]
                records.sort()
                for _, key in records[:kept - int(budget * low_water)]:
                    for chunk_key in codec.chunk_keys(from_bytes([key]), m.chunks):
                        txn.delete(chunk_key, db=self._entries)
                    txn.delete(key, db=self._kept)
                    out["evicted"] += 1
                kept = txn.stat(self._kept)["entries"]
            out["kept"] = kept

        self._write(write)
        return out

    def kept(self) -> dict[int, tuple[int, int]]:
        """The kept entries: key -> (uses, last used, ms since the epoch)."""
        if self._kept is None:
            return {}
        with self._begin(db=self._kept, buffers=True) as txn:
            return {int(from_bytes([bytes(k)])[0]): KEPT_RECORD.unpack(bytes(v)) for k, v in txn.cursor().iternext()}

    def kept_count(self) -> int:
        if self._kept is None:
            return 0
        with self._begin(db=self._kept) as txn:
            return txn.stat(self._kept)["entries"]

    def clear(self) -> None:
        """Removes every entry, kept ones too (and the build and statistics records) in one transaction."""
        def wipe(txn):
            txn.drop(self._entries, delete=False)
            if self._kept is not None:
                txn.drop(self._kept, delete=False)
            txn.delete(b"build", db=self._meta)
            txn.delete(b"stats", db=self._meta)

        self._write(wipe)

    def stamp(self) -> int:
        """The id of the store's last write transaction: it changes with every write, by any
        process (LMDB's shared lock file)."""
        return int(self.env.info()["last_txnid"])

    def __len__(self) -> int:
        with self._begin(db=self._entries) as txn:
            return txn.stat(self._entries)["entries"] // self.meta.chunks

    def keys(self) -> np.ndarray:
        """All keys in order (uint64)."""
        c = self.meta.chunks
        with self._begin(db=self._entries, buffers=True) as txn:
            keys = txn.cursor().iternext(keys=True, values=False)
            raw = b"".join(bytes(k[:8]) for i, k in enumerate(keys) if i % c == 0)
        return np.frombuffer(raw, dtype=">u8").astype(np.uint64)

    def stats(self) -> dict:
        """Entries by n-gram order and bytes (values and the file on disk)."""
        order = ngram_order(self.keys())
        n = int(order.size)
        return {"entries": n, "trigrams": int((order == 3).sum()), "bigrams": int((order == 2).sum()),
                "unigrams": int((order == 1).sum()), "kept": self.kept_count(), "value_bytes": n * self.meta.value_bytes,
                "file_bytes": (self.path / "data.mdb").stat().st_size}

    def close(self) -> None:
        self._guard.exclusive(self.env.close)

    # -- internals -----------------------------------------------------------------------------
    @contextmanager
    def _begin(self, **kw):
        """A transaction of this store (read-only unless ``write=True``), held against a resize of
        the map (``MapGuard``); when a writer in another process grew the file past this process's
        map (a PLOT read while it is built), the map is first grown to the file (LMDB's
        MDB_MAP_RESIZED)."""
        while True:
            with self._guard.using():
                try:
                    txn = self.env.begin(**kw)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            self._guard.exclusive(lambda: self.env.set_mapsize(0))

    def _grow_to_fit(self) -> None:
        used = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
        if used * 2 > self.env.info()["map_size"]:
            self.env.set_mapsize(max(INITIAL_MAP_SIZE, used * 2))

    def _write(self, fn) -> None:
        if self.readonly:
            raise PermissionError(f"PLOT at {self.path} is open read-only")
        while True:
            try:
                with disk_writes(self.path), self._begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self._guard.exclusive(lambda: self.env.set_mapsize(self.env.info()["map_size"] * 2))


class MapGuard:
    """LMDB may resize (or close) an environment's map only while no transaction of the process
    uses it: a read's buffers point into the map, and a remap under them is a crash.  A store
    read by request threads while a writer thread grows it (the kept misses of compute+insert,
    ``hmi.plot.kept``) therefore takes this guard: transactions share it (``using``), a resize
    waits for them to end and holds new ones back meanwhile (``exclusive``)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._using = 0
        self._exclusive = False

    @contextmanager
    def using(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._using += 1
        try:
            yield
        finally:
            with self._cond:
                self._using -= 1
                self._cond.notify_all()

    def exclusive(self, fn):
        with self._cond:
            while self._exclusive or self._using:
                self._cond.wait()
            self._exclusive = True
        try:
            return fn()
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
