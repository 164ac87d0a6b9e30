"""The finished cells of a long benchmark (``benchmarks/cells.py``): the same command run again
reads back what an earlier run finished, a time limit stops one invocation without losing a
finished cell, and another configuration never reads this one's cells."""

import json

import pytest

from benchmarks.cells import Cells
from hmi.timelimit import OutOfTime

CONFIG = {"root_artifact": "a", "epochs": 4}


def counting(calls: list, value: float):
    def fn():
        calls.append(value)
        return {"dev": value, "test": value / 2}
    return fn


def test_a_cell_finished_by_one_run_is_read_back_by_the_next_without_running_again(tmp_path):
    calls = []
    first = Cells("bench", CONFIG, home=tmp_path)
    assert first.run({"task": "t", "lr": 1e-4}, counting(calls, 0.8)) == {"dev": 0.8, "test": 0.4}
    again = Cells("bench", CONFIG, home=tmp_path)
    assert again.run({"task": "t", "lr": 1e-4}, counting(calls, 0.1)) == {"dev": 0.8, "test": 0.4}
    assert again.run({"task": "t", "lr": 2e-5}, counting(calls, 0.7)) == {"dev": 0.7, "test": 0.35}
    assert calls == [0.8, 0.7] and (again.ran, again.reused) == (1, 1)


def test_another_configuration_runs_its_own_cells_and_fresh_forgets_them(tmp_path):
    calls = []
    Cells("bench", CONFIG, home=tmp_path).run({"task": "t"}, counting(calls, 0.8))
    Cells("bench", {**CONFIG, "epochs": 5}, home=tmp_path).run({"task": "t"}, counting(calls, 0.6))
    Cells("bench", CONFIG, fresh=True, home=tmp_path).run({"task": "t"}, counting(calls, 0.5))
    assert calls == [0.8, 0.6, 0.5]


def test_an_unreadable_cell_is_run_again(tmp_path):
    calls = []
    cells = Cells("bench", CONFIG, home=tmp_path)
    cells.run({"task": "t"}, counting(calls, 0.8))
    (cell,) = cells.folder.glob("cell-*.json")
    cell.write_text('{"key": {"task": "t"}, "resu')  # cut short
    assert Cells("bench", CONFIG, home=tmp_path).run({"task": "t"}, counting(calls, 0.6)) == {"dev": 0.6, "test": 0.3}
    assert calls == [0.8, 0.6]


def test_a_time_limit_stops_the_invocation_after_a_finished_cell_and_the_next_one_continues(tmp_path):
    calls = []
    keys = [{"task": "t", "lr": lr} for lr in (1e-4, 5e-5, 2e-5)]
    for expected in ([1e-4], [1e-4, 5e-5], [1e-4, 5e-5, 2e-5]):
        cells = Cells("bench", CONFIG, max_minutes=1e-9, home=tmp_path)  # spent as soon as one cell ran
        try:
            for k in keys:
                cells.run(k, counting(calls, k["lr"]))
        except OutOfTime:
            pass
        assert calls == expected  # one new cell per invocation, none run twice
    with pytest.raises(OutOfTime):
        cells = Cells("bench", {**CONFIG, "epochs": 9}, max_minutes=1e-9, home=tmp_path)
        for k in keys:
            cells.run(k, counting(calls, 0.0))


def test_an_invocation_that_trains_nothing_reads_finished_cells_back_and_stops_at_the_first_unfinished(tmp_path):
    calls = []
    keys = [{"task": "t", "lr": lr} for lr in (1e-4, 5e-5)]
    Cells("bench", CONFIG, home=tmp_path).run(keys[0], counting(calls, 1e-4))
    cells = Cells("bench", CONFIG, home=tmp_path, train=False)
    assert cells.run(keys[0], counting(calls, 0.0)) is not None  # read back
    with pytest.raises(OutOfTime, match="trains nothing"):
        cells.run(keys[1], counting(calls, 5e-5))
    assert calls == [1e-4]  # nothing ran in the second invocation, not even one cell


def test_work_that_keeps_its_own_result_counts_against_the_same_time_limit_as_cells(tmp_path):
    """A benchmark's branch (published by its own job, not a cell file) runs under the same limit:
    the invocation's first piece of work always runs, none starts once the minutes are spent."""
    done = []
    cells = Cells("bench", CONFIG, max_minutes=1e-9, home=tmp_path)
    assert cells.work(lambda: done.append("branch") or "node") == "node"
    with pytest.raises(OutOfTime):
        cells.run({"task": "t"}, counting(done, 0.5))
    with pytest.raises(OutOfTime):
        cells.work(lambda: done.append("second branch"))
    assert done == ["branch"] and cells.ran == 1


def test_a_table_recorded_on_one_home_continues_on_a_fresh_home_from_its_record(tmp_path):
    """A lost home loses nothing the record holds: another home with the same record reads its
    cells back and adds the new ones."""
    calls, record = [], tmp_path / "docs" / "cells"
    first = Cells("bench", CONFIG, home=tmp_path / "a", record_dir=record)
    first.run({"task": "t", "lr": 1e-4}, counting(calls, 0.8))
    first.run({"task": "t", "lr": 5e-5}, counting(calls, 0.7))
    elsewhere = Cells("bench", CONFIG, home=tmp_path / "b", record_dir=record)
    assert elsewhere.run({"task": "t", "lr": 1e-4}, counting(calls, 0.1)) == {"dev": 0.8, "test": 0.4}
    assert elsewhere.run({"task": "t", "lr": 5e-5}, counting(calls, 0.1)) == {"dev": 0.7, "test": 0.35}
    elsewhere.run({"task": "t", "lr": 2e-5}, counting(calls, 0.6))
    assert calls == [0.8, 0.7, 0.6] and (elsewhere.ran, elsewhere.reused) == (1, 2)
    (path,) = record.glob("bench-*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"config": CONFIG} and [c["key"]["lr"] for c in lines[1:]] == [1e-4, 5e-5, 2e-5]
    assert all("CPU cores" in c["machine"] for c in lines[1:])  # each cell says where it was measured


def test_cells_kept_in_a_home_join_the_record_when_read_back(tmp_path):
    calls, record = [], tmp_path / "cells"
    Cells("bench", CONFIG, home=tmp_path / "a").run({"task": "t"}, counting(calls, 0.8))
    Cells("bench", CONFIG, home=tmp_path / "a", record_dir=record).run({"task": "t"}, counting(calls, 0.1))
    assert Cells("bench", CONFIG, home=tmp_path / "b", record_dir=record).run({"task": "t"}, counting(calls, 0.1)) \
        == {"dev": 0.8, "test": 0.4}
    assert calls == [0.8]


def test_a_record_cut_short_or_of_another_configuration_is_not_read_and_fresh_removes_it(tmp_path):
    calls, record = [], tmp_path / "cells"
    cells = Cells("bench", CONFIG, home=tmp_path / "a", record_dir=record)
    for task in ("t", "u"):
        cells.run({"task": task}, counting(calls, 0.8))
    cells.record.write_text(cells.record.read_text()[:-10])  # the last line cut short by a crash
    again = Cells("bench", CONFIG, home=tmp_path / "b", record_dir=record)
    again.run({"task": "t"}, counting(calls, 0.1))
    again.run({"task": "u"}, counting(calls, 0.6))
    assert calls == [0.8, 0.8, 0.6]
    # A record whose first line names another configuration (edited, or of other code) is not read.
    other = Cells("bench", {**CONFIG, "epochs": 5}, home=tmp_path / "c", record_dir=record)
    other.record.write_text(cells.record.read_text())
    Cells("bench", {**CONFIG, "epochs": 5}, home=tmp_path / "c", record_dir=record).run({"task": "t"}, counting(calls, 0.5))
    assert calls == [0.8, 0.8, 0.6, 0.5]
    Cells("bench", CONFIG, fresh=True, home=tmp_path / "b", record_dir=record)
    assert not cells.record.exists()


def test_a_cell_another_configuration_recorded_is_adopted_only_where_adopt_says_and_joins_this_record(tmp_path):
    """``adopt``: an accuracy table of a new artifact reads the columns that do not depend on the
    artifact from an earlier artifact's record, and runs the others; a record of other settings, or
    of another benchmark, lends nothing."""
    calls, record = [], tmp_path / "cells"
    earlier = Cells("bench", CONFIG, home=tmp_path / "a", record_dir=record)
    earlier.run({"scheme": "free"}, counting(calls, 0.8))
    earlier.run({"scheme": "windows"}, counting(calls, 0.7))
    Cells("other", {**CONFIG, "root_artifact": "b"}, home=tmp_path / "a", record_dir=record).run(
        {"scheme": "free", "lr": 1}, counting(calls, 0.5))
    Cells("bench", {**CONFIG, "root_artifact": "c", "epochs": 5}, home=tmp_path / "a", record_dir=record).run(
        {"scheme": "free", "lr": 2}, counting(calls, 0.4))

    def adopt(config, key):
        return key["scheme"] == "free" and config["epochs"] == 4

    new = Cells("bench", {**CONFIG, "root_artifact": "b"}, home=tmp_path / "b", record_dir=record, adopt=adopt)
    assert new.run({"scheme": "free"}, counting(calls, 0.1)) == {"dev": 0.8, "test": 0.4}
    assert new.run({"scheme": "windows"}, counting(calls, 0.6)) == {"dev": 0.6, "test": 0.3}
    new.run({"scheme": "free", "lr": 1}, counting(calls, 0.3))  # the other benchmark's cell: run here
    new.run({"scheme": "free", "lr": 2}, counting(calls, 0.2))  # other settings: run here
    assert calls == [0.8, 0.7, 0.5, 0.4, 0.6, 0.3, 0.2] and (new.ran, new.reused) == (3, 1)
    mine = [json.loads(line) for line in new.record.read_text().splitlines()]
    assert mine[0] == {"config": {**CONFIG, "root_artifact": "b"}} and mine[1]["key"] == {"scheme": "free"}
    # without adopt (eval_accuracy's --fresh), the earlier record lends nothing
    alone = Cells("bench", {**CONFIG, "root_artifact": "d"}, home=tmp_path / "c", record_dir=record)
    alone.run({"scheme": "free"}, counting(calls, 0.9))
    assert calls[-1] == 0.9


def test_tensors_several_cells_read_are_computed_once_and_read_back_by_a_run_continued_after_a_stop(tmp_path):
    """A distilled column's teacher answers: computed where first needed, then read back, by the same
    run and by the next; other answers (another key) are computed; a file cut short is computed again."""
    import torch

    calls = []

    def answers(scale):
        def compute():
            calls.append(scale)
            return [torch.full((3,), float(scale)), torch.arange(4.0).reshape(2, 2) * scale]
        return compute

    key = {"task": "t", "seed": 0, "answers_to": "abc"}
    first = Cells("bench", CONFIG, home=tmp_path).tensors(key, answers(1))
    again = Cells("bench", CONFIG, home=tmp_path).tensors(key, answers(2))
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(first, again)) and len(again) == 2
    other = Cells("bench", CONFIG, home=tmp_path).tensors({**key, "seed": 1}, answers(3))
    assert calls == [1, 3] and torch.equal(other[0], torch.full((3,), 3.0))
    for f in (tmp_path / "runs" / "bench").rglob("tensors-*.pt"):
        f.write_bytes(f.read_bytes()[:20])
    assert torch.equal(Cells("bench", CONFIG, home=tmp_path).tensors(key, answers(4))[0], torch.full((3,), 4.0))
    assert calls == [1, 3, 4]
