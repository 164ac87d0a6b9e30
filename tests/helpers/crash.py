"""What the crash-safety tests' child processes write before they are killed: an adapter spec and weights, a domain tree."""

import torch

from hmi.adapters.spec import AdapterSpec

SPEC = AdapterSpec("bottleneck", labels=("a", "b"))


def weights(value: float) -> dict:
    return {"layers.0.bn.down_w": torch.full((32, 2), value), "head.w": torch.full((32, 2), value),
            "head.b": torch.full((2,), value)}


def open_tree(home):
    from pathlib import Path

    from hmi.model.artifact import Root
    from hmi.model.hplm import WindowedEncoder
    from hmi.model.root import RootSpec, default_spec, load_tokenizer
    from hmi.version_tree.tree import VersionTree
    from tests.conftest import tiny_bert

    spec = RootSpec(default_spec().model_dir, 2)
    bert = tiny_bert(layers=4, hidden=32, vocab=30522)
    root = Root(spec, bert, load_tokenizer(spec.model_dir), WindowedEncoder(bert, 2).eval(), "tinyroot", {})
    return VersionTree(root, Path(home))
