"""The tenant fine-tune trains on the served forward pass (``TenantModel``); the ``adapters``
library's own model is the slow, obvious reference: the same data, seed and dropout masks must
give the same weights after every step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hmi.adapters.batched import pooled
from hmi.adapters.interop import attach, from_library, library_model, to_library
from hmi.adapters.spec import AdapterSpec
from hmi.model.hplm import UpperLayers
from hmi.training.finetune import HEAD_DROPOUT, initial_weights, tenant_model
from tests.conftest import tiny_bert

H, L_LOW, NAME = 32, 2, "ref"

SPECS = {
    "lora-all": AdapterSpec("lora", labels=("a", "b", "c"), rank=4, targets=("q", "k", "v", "ffn_in", "ffn_out")),
    "lora-tagging": AdapterSpec("lora", labels=("O", "X"), rank=2, head="tagging"),
    "bottleneck-mean": AdapterSpec("bottleneck", labels=("a", "b"), reduction_factor=4, pooling="mean"),
    "ia3": AdapterSpec("ia3", labels=("a", "b", "c")),
}


class LibraryTrainer:
    """The reference: the adapter attached with the ``adapters`` library to a private copy of the
    root, its layers in training mode, the head an ``nn.Linear`` behind ``nn.Dropout``."""

    def __init__(self, bert, spec: AdapterSpec, weights: dict):
        self.spec = spec
        self.model = library_model(bert)
        attach(self.model, NAME, spec, L_LOW, train=True)
        to_library(self.model, NAME, spec, L_LOW, weights)
        self.upper = UpperLayers(self.model, L_LOW)
        self.head = nn.Linear(H, spec.num_labels)
        with torch.no_grad():
            self.head.weight.copy_(weights["head.w"].t())
            self.head.bias.copy_(weights["head.b"])
        self.dropout = nn.Dropout(HEAD_DROPOUT)

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad] + list(self.head.parameters())

    def logits(self, x, mask):
        self.model.train()
        out = self.dropout(self.upper(x, mask))
        if self.spec.head == "tagging":
            return self.head(out)
        return self.head(pooled(out, mask, self.spec.pooling == "mean"))

    def weights(self):
        w = from_library(self.model, NAME, self.spec, L_LOW)
        w["head.w"], w["head.b"] = self.head.weight.detach().t(), self.head.bias.detach()
        return w


def dropping_bert():
    """A root whose layers drop as the real roots' do (0.1), so that the masks must line up."""
    bert = tiny_bert(hidden=H)
    bert.config.hidden_dropout_prob = bert.config.attention_probs_dropout_prob = 0.1
    for m in bert.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    return bert


def train_steps(model, spec, batches, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for x, mask, y in batches:
        logits = model.logits(x, mask, train=True) if not isinstance(model, LibraryTrainer) else model.logits(x, mask)
        loss = F.cross_entropy(logits.reshape(-1, spec.num_labels), y.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.weights()


@pytest.fixture
def float64_default():
    """Both models built and trained in float64.  Adam divides each gradient element by its own
    running magnitude, so where an element is near zero a float32 rounding difference between two
    orders of operations (the library's GEMMs against the served kernels, AVX-512 against AVX2)
    becomes a weight difference of up to the learning rate: no float32 tolerance separates that
    from a wrong mask.  In float64 a gradient element differs by about 1e-17 between the two
    orders; Adam turns that into at most lr * 1e-17 / eps (eps = 1e-8) = 1e-11 a step, three
    steps 3e-11, while a wrong dropout mask, site or scaling moves weights by 1e-3 or more."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


FLOAT64_ATOL = 1e-9  # 30 times the bound derived above; 1e6 times below a real difference


@pytest.mark.parametrize("name", list(SPECS))
def test_a_fine_tune_step_equals_the_adapters_library_model_trained_with_the_same_dropout(name, float64_default):
    spec = SPECS[name]
    bert = dropping_bert()
    gen = torch.Generator().manual_seed(1)
    weights = initial_weights(bert.config, L_LOW, spec, seed=3)
    with torch.no_grad():  # away from the library's zero start, so that every tensor matters
        weights = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    batches = []
    for _ in range(3):
        x = torch.randn(4, 7, H, generator=gen)
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 5:] = 0
        mask[3, 3:] = 0
        y = (torch.randint(0, spec.num_labels, (4, 7), generator=gen) if spec.head == "tagging"
             else torch.randint(0, spec.num_labels, (4,), generator=gen))
        if spec.head == "tagging":
            y[mask == 0] = -100
        batches.append((x, mask, y))
    want = train_steps(LibraryTrainer(bert, spec, weights), spec, batches)
    got = train_steps(tenant_model(bert, L_LOW, spec, weights), spec, batches)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == torch.float64, k
        torch.testing.assert_close(got[k], want[k].reshape(got[k].shape), atol=FLOAT64_ATOL, rtol=0, msg=k)
    moved = max(float((got[k] - weights[k]).abs().max()) for k in got)
    assert moved > 1e-3  # the steps did train


def test_a_new_tenant_starts_from_the_library_initialization_without_touching_the_root():
    spec = SPECS["lora-all"]
    bert = tiny_bert(hidden=H)
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    torch.manual_seed(3)
    lib = library_model(bert)
    attach(lib, NAME, spec, L_LOW, train=True)
    want = from_library(lib, NAME, spec, L_LOW)
    head = nn.Linear(H, spec.num_labels)
    got = initial_weights(bert.config, L_LOW, spec, seed=3)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    torch.testing.assert_close(got["head.w"], head.weight.detach().t(), atol=0, rtol=0)
    assert not hasattr(bert, "adapters_config")
    for k, v in bert.state_dict().items():
        assert torch.equal(v, before[k])
