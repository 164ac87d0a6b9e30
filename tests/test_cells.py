"""The finished cells of a long benchmark (``benchmarks/cells.py``): the same command run again
reads back what an earlier run finished, a time limit stops one invocation without losing a
finished cell, and another configuration never reads this one's cells."""

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
