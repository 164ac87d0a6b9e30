"""The settings a tenant's fine-tune trains on each root: where dev chooses the pooling of a
classification head and where the root fixes it (``hmi.services.workers.starting_pooling``)."""

from dataclasses import replace

from hmi.adapters.spec import AdapterSpec
from hmi.services.workers import starting_pooling
from hmi.training.finetune import GRID_LRS, dev_options

SPEC = AdapterSpec.for_task("classification", ["neg", "pos"])


def test_on_mpnet_base_a_fine_tune_reads_the_mean_as_its_tables_do_unless_the_tenant_named_another_pooling():
    spec, kept = starting_pooling(SPEC, named=False, continued=False, source="mpnet-base")
    assert spec.pooling == "mean" and dev_options(spec, True, keep_pooling=kept) == [("mean", r) for r in GRID_LRS]
    named = replace(SPEC, pooling="cls")
    assert starting_pooling(named, named=True, continued=False, source="mpnet-base") == (named, True)
    tagging = AdapterSpec.for_task("tagging", ["N", "V"])
    assert starting_pooling(tagging, named=False, continued=False, source="mpnet-base") == (tagging, False)


def test_on_the_default_root_dev_chooses_the_pooling_unless_named_or_continued():
    assert starting_pooling(SPEC, named=False, continued=False, source=None) == (SPEC, False)
    assert len(dev_options(SPEC, True, keep_pooling=False)) == 2 * len(GRID_LRS)
    assert starting_pooling(SPEC, named=False, continued=True, source=None) == (SPEC, True)
    assert starting_pooling(SPEC, named=False, continued=False, source="/models/some-bert") == (SPEC, False)
