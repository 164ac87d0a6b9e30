"""A tiny decoder world for the generation engine's tests: a character tokenizer, a causal PLOT, library-trained tenants."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hmi.adapters.interop import attach, from_library, library_model
from hmi.adapters.spec import AdapterSpec
from hmi.hgpt.generation import EngineConfig, GenerationEngine
from hmi.model.decoder import CausalLower, DecoderRoot
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore

L_LOW, VOCAB = 2, 90


class CharTokenizer:
    """Characters as tokens (ids 3..), enough to drive the engine without a real vocabulary."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, truncation=False, max_length=None, padding=False,
                 return_tensors=None):
        one = lambda t: [3 + (ord(c) % (VOCAB - 3)) for c in t][:max_length if truncation else None]  # noqa: E731
        if not isinstance(text, list):
            return {"input_ids": one(text)}
        ids = [one(t) for t in text]
        if not padding:
            return {"input_ids": ids}
        T = max(len(x) for x in ids)
        out = {"input_ids": [x + [0] * (T - len(x)) for x in ids], "attention_mask": [[1] * len(x) + [0] * (T - len(x)) for x in ids]}
        return {k: torch.tensor(v) for k, v in out.items()} if return_tensors == "pt" else out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord(" ") + (i - 3) % 95) for i in ids)

    def convert_tokens_to_ids(self, token):
        return None


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    root = DecoderRoot(model, CharTokenizer(), L_LOW)
    store = PlotStore(tmp_path_factory.mktemp("plot") / "p", meta=PlotMeta("tiny", L_LOW, 32, n=1, kind="causal"),
                      readonly=False)
    lookup = PlotLookup([PlotVersion("root", store, CausalLower(root))], policy="compute")
    lib = library_model(model)
    tenants = {}
    g = torch.Generator().manual_seed(1)
    for i, spec in enumerate([AdapterSpec.decoder(rank=4, alpha=a) for a in (8, 4, 16)]):
        name = f"t{i}"
        attach(lib, name, spec, L_LOW)
        with torch.no_grad():
            for n, p in lib.named_parameters():
                if f".loras.{name}." in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        tenants[name] = (spec, from_library(lib, name, spec, L_LOW))
    return root, lookup, lib, tenants


def engine(world, **kw):
    root, lookup, _, tenants = world
    return GenerationEngine(root, lookup, tenants.__getitem__, EngineConfig(rank=4, max_len=96, **kw))


PROMPTS = [("t0", "hello world"), ("t1", "the cat sat on"), ("t2", "abc"), ("t0", "a much longer prompt here"),
           ("t1", "x"), ("t2", "hello world")]
