"""eval_accuracy's choice of tasks, which runs make a partial page, the page's description of its columns,
the keys of its cells, and its runs over several seeds
(``benchmarks.eval_accuracy.seeded_cells``): seed 0 is the one-seed table's run, read back rather
than trained again; every other seed trains every option and dev chooses per seed."""

import json
from pathlib import Path

import pytest

from benchmarks.cells import Cells
from benchmarks.eval_accuracy import (
    ALL_SCHEMES,
    HBERT_AUTO,
    HBERT_DISTILLED,
    HBERT_DISTILLED_COMPUTE,
    HBERT_LEARNED,
    PAGE_SUFFIXES,
    TASKS,
    cell_key,
    chosen_tasks,
    default_schemes,
    page_suffix,
    partial_table,
    scheme_descriptions,
    seeded_cells,
    served_auto,
)

KEY = {"task": "t", "train": 8, "scheme": "hBERT"}
OPTIONS = [("cls", 3e-3), ("mean", 3e-3)]


def trainer(calls: list, table: dict):
    def train(option, seed):
        calls.append((option, seed))
        dev, test = table[(option, seed)]
        return {"dev": dev, "test": test, "seconds": 1.0}
    return train


def test_seed_zero_is_the_one_seed_tables_cells_and_other_seeds_train_every_option(tmp_path):
    table = {(("cls", 3e-3), 0): (0.9, 0.8), (("mean", 3e-3), 0): (0.7, 0.95),
             (("cls", 3e-3), 1): (0.6, 0.5), (("mean", 3e-3), 1): (0.8, 0.7)}
    calls = []
    one = seeded_cells(Cells("bench", {"c": 1}, home=tmp_path), KEY, range(1), OPTIONS, trainer(calls, table))
    assert [(o, r["test"]) for o, r, _ in one] == [(("cls", 3e-3), 0.8)]
    calls.clear()
    two = seeded_cells(Cells("bench", {"c": 1}, home=tmp_path), KEY, range(2), OPTIONS, trainer(calls, table))
    # seed 0 read back, seed 1 trained for both options; each seed keeps the option its dev prefers
    assert calls == [(("cls", 3e-3), 1), (("mean", 3e-3), 1)]
    assert [(o, r["test"]) for o, r, _ in two] == [(("cls", 3e-3), 0.8), (("mean", 3e-3), 0.7)]


def test_a_seeds_own_options_are_trained_alone_as_a_distilled_student_trains_at_its_teachers_pooling(tmp_path):
    """``options`` as a function of the seed: each seed trains and chooses among its own (the
    distilled columns: every rate at the pooling dev chose for that seed's teacher)."""
    table = {(("cls", 3e-3), 0): (0.9, 0.8), (("cls", 1e-3), 0): (0.95, 0.85),
             (("mean", 3e-3), 1): (0.6, 0.5), (("mean", 1e-3), 1): (0.5, 0.7)}
    teacher_pooling = {0: "cls", 1: "mean"}
    calls = []
    picks = seeded_cells(Cells("bench", {"c": 2}, home=tmp_path), KEY, range(2),
                         lambda seed: [(teacher_pooling[seed], r) for r in (3e-3, 1e-3)], trainer(calls, table))
    assert calls == [(("cls", 3e-3), 0), (("cls", 1e-3), 0), (("mean", 3e-3), 1), (("mean", 1e-3), 1)]
    assert [(o, r["test"]) for o, r, _ in picks] == [(("cls", 1e-3), 0.85), (("mean", 3e-3), 0.5)]


def test_eval_accuracy_runs_the_four_tasks_by_default_and_a_task_outside_them_only_when_named():
    assert chosen_tasks(None) == TASKS and "license-category" not in TASKS
    assert chosen_tasks("license-category") == ["license-category"]
    assert chosen_tasks("license-category,news-topic") == ["news-topic", "license-category"]
    with pytest.raises(SystemExit, match="license-category"):
        chosen_tasks("legal")


def test_the_page_describes_every_column_it_shows_and_no_scheme_the_run_left_out():
    lrs = {label: (3e-3, 1e-3) for label in ALL_SCHEMES}
    assert [label for label, _ in scheme_descriptions(ALL_SCHEMES, lrs, 6, 3, 2000, True)] == ALL_SCHEMES
    two = dict(scheme_descriptions([HBERT_DISTILLED, HBERT_LEARNED], lrs, 6, 3, 2000, True))
    assert list(two) == [HBERT_DISTILLED, HBERT_LEARNED]
    assert "2000 unlabeled lines" in two[HBERT_DISTILLED] and "all 6 layers" in two[HBERT_DISTILLED]
    assert "bf16" in two[HBERT_LEARNED]
    assert "fp32" in dict(scheme_descriptions([HBERT_LEARNED], lrs, 6, 3, 0, False))[HBERT_LEARNED]
    assert "weighted" not in two[HBERT_DISTILLED]  # the default weight goes unsaid
    heavy = dict(scheme_descriptions([HBERT_DISTILLED], lrs, 6, 3, 2000, True, weight=0.9))[HBERT_DISTILLED]
    assert "the teacher's answers weighted 0.9, the labels 0.1" in heavy


def test_a_run_lacking_a_column_of_the_full_table_makes_a_partial_page_however_many_schemes_it_names():
    full = default_schemes(quick=True, exact=False, learned=False)
    assert "dedicated" in full and "hBERT" in full
    assert not partial_table(full, TASKS, full)
    assert not partial_table(full + [HBERT_DISTILLED], TASKS, full)  # a column beyond the table: still the full one
    five = ["shared", "hBERT-adapter", HBERT_LEARNED, HBERT_DISTILLED, HBERT_DISTILLED_COMPUTE]
    assert len(five) >= len(full) and partial_table(five, TASKS, full)  # as many columns, not the table's
    assert partial_table(full, ["news-topic"], full)
    assert partial_table(full, TASKS + ["license-category"], full)


def test_columns_beyond_the_full_table_name_their_page_in_one_order_whatever_order_they_are_asked_in():
    # the names of the pages already written (e.g. eval_accuracy_partial_learned_distilled_grid)
    assert page_suffix([HBERT_DISTILLED, "shared", HBERT_LEARNED]) == "_learned_distilled"
    assert page_suffix([HBERT_DISTILLED_COMPUTE, HBERT_LEARNED, HBERT_DISTILLED]) == "_learned_distilled_distilled-compute"
    assert len({suffix for _, suffix in PAGE_SUFFIXES}) == len(PAGE_SUFFIXES)


def test_a_distilled_student_trained_longer_has_cells_of_its_own_and_the_tables_epochs_keep_the_recorded_keys():
    record = Path(__file__).resolve().parents[1] / "docs/results/cells/eval_accuracy-a2216e4c7e3c93d7.jsonl"
    lines = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    per_cell = ("pooling", "lr", "seed")
    recorded = [{k: v for k, v in c["key"].items() if k not in per_cell} for c in lines
                if c["key"]["scheme"] == HBERT_DISTILLED and c["key"]["task"] == "review-sentiment"]
    table = cell_key("review-sentiment", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None)
    longer = cell_key("review-sentiment", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, 8)
    # the table's own epochs: the key every earlier run wrote, so their cells read back
    assert table in recorded
    # 8 epochs: another key, so a 4-epoch cell is never read back as an 8-epoch one (and the reverse)
    assert longer == {**table, "distil_epochs": 8}
    assert longer in recorded  # the --distil-epochs 8 run's cells
    # a scheme that is not distilled has one key whatever the students' epochs
    assert cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, 8) == \
        {"task": "news-topic", "train": 640, "scheme": "hBERT-adapter"}


def test_a_student_started_from_its_teacher_has_cells_of_its_own_and_a_new_start_keeps_the_recorded_key():
    new = cell_key("review-sentiment", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None)
    assert cell_key("review-sentiment", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None,
                    distil_start="new") == new
    assert cell_key("review-sentiment", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None,
                    distil_start="teacher") == {**new, "distil_start": "teacher"}
    # the teacher's own cells (hBERT-adapter) are the same whichever way its students start
    assert cell_key("review-sentiment", 640, "hBERT-adapter", None, True, 2000, 0.5, None, distil_start="teacher") == \
        {"task": "review-sentiment", "train": 640, "scheme": "hBERT-adapter"}


def test_a_probe_first_keys_the_adapter_column_and_its_students_apart_and_none_keeps_the_recorded_keys():
    adapter = cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None)
    distilled = cell_key("news-topic", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None)
    assert cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None, probe_first=0) == adapter
    assert cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None, probe_first=2) == \
        {**adapter, "probe_first": 2}
    # a student of such a teacher is another student; a column that has no teacher is the same column
    assert cell_key("news-topic", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None, probe_first=2) == \
        {**distilled, "teacher_probe_first": 2}
    assert cell_key("news-topic", 640, "shared", None, True, 2000, 0.5, None, probe_first=2) == \
        {"task": "news-topic", "train": 640, "scheme": "shared"}


def test_a_head_rate_keys_the_adapter_columns_and_their_students_apart_and_leaves_the_others_and_none_alone():
    adapter = cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None)
    distilled = cell_key("news-topic", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None)
    assert cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None, head_lr=None) == adapter
    assert cell_key("news-topic", 640, "hBERT-adapter", None, True, 2000, 0.5, None, head_lr=0.01) == \
        {**adapter, "head_lr": 0.01}
    # a student trains its own head at that rate, and its teacher trained its head at it too
    assert cell_key("news-topic", 640, HBERT_DISTILLED, "d92b6e3db6f4b6c2", True, 2000, 0.5, None, head_lr=0.01) == \
        {**distilled, "head_lr": 0.01, "teacher_head_lr": 0.01}
    # every weight at one rate, or the head alone: the same column whatever the flag
    for scheme in ("shared", "dedicated", "compress"):
        assert cell_key("news-topic", 640, scheme, None, True, 2000, 0.5, None, head_lr=0.01) == \
            {"task": "news-topic", "train": 640, "scheme": scheme}


def test_a_table_of_another_artifact_adopts_only_the_columns_that_never_read_the_windows():
    from benchmarks.eval_accuracy import ARTIFACT_FREE, artifact_free

    record = Path(__file__).resolve().parents[1] / "docs/results/cells/eval_accuracy-a2216e4c7e3c93d7.jsonl"
    config = json.loads(record.read_text().splitlines()[0])["config"]
    adopt = artifact_free({**config, "root_artifact": "minilm-l3-other", "plot": "another", "l_low": 2})
    assert all(adopt(config, {"task": "t", "scheme": s}) for s in ARTIFACT_FREE)
    for scheme in ("hBERT", HBERT_LEARNED, HBERT_DISTILLED, "hBERT-adapter, upper layers"):
        assert not adopt(config, {"task": "t", "scheme": scheme})  # these read the windows or the split
    assert not adopt({**config, "epochs": 5}, {"task": "t", "scheme": "shared"})  # other settings
    assert not adopt({**config, "root": "mpnet-base"}, {"task": "t", "scheme": "shared"})  # another root


def test_the_served_auto_column_takes_the_teacher_only_where_it_leads_on_dev_by_more_than_the_margin():
    """Per seed, as a fine-tune with ``"serving": "auto"`` chooses: the teacher's test accuracy where
    its dev accuracy leads the student's by more than 0.03, the student's otherwise (ties and small
    leads stay on the windows)."""
    teacher = [{"dev": 0.806, "test": 0.768}, {"dev": 0.80, "test": 0.77}, {"dev": 0.96, "test": 0.96}]
    student = [{"dev": 0.752, "test": 0.731}, {"dev": 0.78, "test": 0.73}, {"dev": 0.94, "test": 0.95}]
    assert served_auto(teacher, student) == [("whole", 0.768), ("windows", 0.73), ("windows", 0.95)]
    lrs = {label: (3e-3,) for label in ALL_SCHEMES}
    assert "0.03" in dict(scheme_descriptions([HBERT_AUTO], lrs, 6, 3, 2000, True))[HBERT_AUTO]


def test_a_distilled_columns_teacher_is_trained_once_and_its_answers_read_back_after_a_stop(tmp_path):
    """``kept_teacher``: the teacher is trained where a student first asks for answers (inside the
    student's no-grad call, so with grad enabled for its own training), its answers kept; a second
    student, and a run continued after a stop, read the same answers back without training it;
    answers to other examples are asked of the teacher."""
    import torch

    from benchmarks.eval_accuracy import kept_teacher
    from hmi.training.examples import Example

    trained = []

    def train():
        assert torch.is_grad_enabled(), "the teacher trains without grad"
        trained.append(1)
        return {"teacher": lambda exs: [torch.tensor([float(sum(e.ids)), float(len(trained))]) for e in exs]}

    exs = [Example([1, 2, 3], 0), Example([4, 5], 1)]
    key = {"task": "t", "seed": 0, "pooling": "mean", "lr": 3e-3}
    answers, _ = kept_teacher(Cells("bench", {"c": 1}, home=tmp_path), key, train)
    with torch.no_grad():  # as Distillation.extend asks
        first = answers(exs)
        second = answers(exs)
    assert trained == [1] and all(torch.equal(a, b) for a, b in zip(first, second))
    again, model = kept_teacher(Cells("bench", {"c": 1}, home=tmp_path), key, train)  # a run continued
    assert all(torch.equal(a, b) for a, b in zip(again(exs), first)) and trained == [1]
    other = again([Example([7], 0)])
    assert trained == [1, 1] and other[0].tolist() == [7.0, 2.0] and model()["teacher"] is not None


def test_a_teacher_whose_cell_ran_in_the_same_invocation_is_that_cells_model_not_trained_again(tmp_path):
    """``TrainedAdapters``: hBERT-adapter's cells of a seed keep their models until the distilled
    column's teacher is chosen among them; the chosen one answers as the teacher without a second
    training, the seed's others are let go, and a teacher whose cell was read back (a run continued
    after a stop) is trained on first use."""
    import torch

    from benchmarks.eval_accuracy import TrainedAdapters, kept_teacher
    from hmi.adapters.spec import AdapterSpec
    from hmi.training.examples import Example

    trained = []

    def train(spec, lr, seed):
        trained.append((lr, seed))
        return {"dev": {"accuracy": lr}, "teacher": lambda exs: [torch.tensor([lr, float(seed)]) for _ in exs]}

    spec = AdapterSpec.for_task("classification", ("a", "b"), pooling="mean")
    adapters = TrainedAdapters(train)
    cells = {lr: adapters.trained_for_cell(spec, lr, 1) for lr in (3e-3, 1e-3)}  # seed 1's cells
    assert trained == [(3e-3, 1), (1e-3, 1)]
    chosen = adapters.teacher(spec, 3e-3, 1)
    assert chosen() is cells[3e-3] and trained == [(3e-3, 1), (1e-3, 1)] and adapters.kept == {}
    answers, _ = kept_teacher(Cells("bench", {"c": 1}, home=tmp_path), {"seed": 1, "lr": 3e-3}, chosen)
    with torch.no_grad():
        assert torch.equal(answers([Example([1, 2], 0)])[0], torch.tensor([3e-3, 1.0])) and len(trained) == 2
    read_back = adapters.teacher(spec, 1e-3, 2)  # seed 2's cells were read back: nothing kept
    assert len(trained) == 2
    assert read_back()["dev"]["accuracy"] == 1e-3 and trained[-1] == (1e-3, 2)
