"""Roots by name: aliases, checkpoint folders (converted once into HMI_HOME), splits, pointers, and what
`--miss-policy auto` serves on each."""

import pytest

from hmi.model.aliases import ALIASES, DEFAULT_ROOT, auto_miss_policy, pointer_name, source_of
from hmi.model.catalog import RootUnavailableError, resolve_root, root_spec
from hmi.model.root import default_spec
from tests.helpers.checkpoints import tiny_checkpoint


def test_the_default_alias_is_the_packaged_minilm_with_its_first_names():
    spec = root_spec("minilm-l6", home=None)
    assert spec == default_spec(3)
    assert (spec.source, spec.prefix, spec.pointer) == (None, "minilm", "current")


def test_auto_serves_each_packaged_roots_choice_at_its_default_split_and_the_learned_back_off_elsewhere():
    for alias, root in ALIASES.items():
        source = None if alias == DEFAULT_ROOT else alias
        assert auto_miss_policy(source, root.l_low) == root.miss_policy
        assert auto_miss_policy(source, root.l_low + 1) == "learned"  # another split: not what its front chose
    assert auto_miss_policy(None, 3) == "learned"  # the default root's front: docs/front.md
    assert auto_miss_policy("/models/my-bert", 3) == "learned"


def test_each_split_of_the_default_root_has_its_own_pointer_so_calibrating_one_leaves_the_served_default_alone():
    """`hmi calibrate --l-low 2` must not repoint what a plain `hmi serve` (L_low=3) loads."""
    assert default_spec(2).pointer == "current-minilm-l6-l2"
    assert len({default_spec(n).pointer for n in (1, 2, 3, 4)}) == 4


def test_an_mpnet_folder_is_converted_once_into_the_home_and_split_where_asked(tmp_path):
    src = tiny_checkpoint(tmp_path, "mpnet")
    spec = root_spec(str(src), 2, home=tmp_path / "home", log=lambda *_: None)
    assert spec.model_dir.startswith(str(tmp_path / "home" / "models" / "converted-"))
    assert (spec.source, spec.prefix, spec.l_low) == (str(src.resolve()), "custom", 2)
    assert spec.pointer == pointer_name(source_of(str(src)), 2) != "current"
    said = []
    assert str(resolve_root(str(src), tmp_path / "home", log=said.append)) == spec.model_dir
    assert said == []  # converted already: nothing done the second time


def test_a_bert_folder_is_read_in_place(tmp_path):
    folder = default_spec().model_dir
    assert str(resolve_root(folder, tmp_path)) == folder


@pytest.mark.parametrize("name,l_low,msg", [("gpt-7", None, "unknown root 'gpt-7'"),
                                             ("minilm-l6", 6, "--l-low must be 1 to 5"),
                                             ("PATH", None, "say where to split it")])
def test_roots_that_cannot_be_had_or_split_say_why(tmp_path, name, l_low, msg):
    if name == "PATH":
        name = str(tiny_checkpoint(tmp_path, "roberta"))
    with pytest.raises(RootUnavailableError, match=msg):
        root_spec(name, l_low, home=tmp_path / "home", log=lambda *_: None)
