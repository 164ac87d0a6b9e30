"""The adapters library's side of the adapter tests: a tiny BERT with a library adapter and head, saved as the library saves it."""

import copy

import torch
from adapters import BertAdapterModel, IA3Config

from tests.conftest import tiny_bert

L_LOW, H, LAYERS = 2, 32, 4


def library_folder(tmp_path, config, name="mine", labels=("neg", "pos", "meh"), head_layers=1, seed=0, bert=None,
                   head=None):
    """An adapter trained 'elsewhere': a library AdapterModel on ``bert`` (a tiny root by default)
    with random adapter and head weights, saved as the library saves it.  ``head``: None for a
    classification head of ``head_layers`` (tanh between layers), or a callable that adds the
    head to the model itself (e.g. the library's defaults)."""
    bert = bert if bert is not None else tiny_bert(layers=LAYERS, hidden=H)
    model = BertAdapterModel(copy.deepcopy(bert.config))  # the library records heads in the config
    model.bert.load_state_dict(bert.state_dict(), strict=False)
    model.add_adapter(name, config=config)
    if head is None:
        model.add_classification_head(name, num_labels=len(labels), layers=head_layers,
                                      id2label=dict(enumerate(labels)))
    else:
        head(model, name, labels)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if f".{name}." in pname:
                p.copy_((1.0 if isinstance(config, IA3Config) else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    model.set_active_adapters(name)
    model.eval()
    out = tmp_path / name
    out.mkdir(parents=True)
    model.save_adapter(str(out), name, with_head=True, use_safetensors=True)
    return model, out


def library_head(model, name="mine"):
    """The library's head as a plain stack of its modules (dropouts, linear layers, activations)."""
    return torch.nn.Sequential(*model.heads[name].children())


HEADS = {  # the adapters library's heads: its defaults, and other layer counts and activations
    "classification-default": lambda m, n, labels: m.add_classification_head(n, num_labels=len(labels),
                                                                            id2label=dict(enumerate(labels))),
    "classification-3-relu": lambda m, n, labels: m.add_classification_head(
        n, num_labels=len(labels), layers=3, activation_function="relu", id2label=dict(enumerate(labels))),
    "classification-2-no-activation": lambda m, n, labels: m.add_classification_head(
        n, num_labels=len(labels), layers=2, activation_function=None, id2label=dict(enumerate(labels))),
    "tagging-2-gelu": lambda m, n, labels: m.add_tagging_head(n, num_labels=len(labels), layers=2,
                                                              activation_function="gelu", id2label=dict(enumerate(labels))),
}
