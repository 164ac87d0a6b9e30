"""A tiny encoder world for the scheduler's tests: tenants of every adapter kind, a PLOT computed on demand, a workload."""

import random

import pytest
import torch

from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import AdapterStore
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import default_spec, load_tokenizer
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
from hmi.scheduler.types import FixedTenants, TenantEntry
from hmi.training.finetune import tenant_model
from tests.conftest import tiny_bert

H, L_LOW = 32, 2


KINDS = [AdapterSpec("bottleneck", labels=("a", "b", "c")), AdapterSpec("lora", rank=4, labels=("x", "y")),
         AdapterSpec("ia3", labels=("p", "q", "r", "s")),
         AdapterSpec("bottleneck", head="tagging", labels=("N", "V", "D"))]


TEXTS = [
    "Shares in the bank fell sharply after the results were published on Monday.",
    "A tender, funny film that never quite finds its footing.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
    "I would never trust a self-driving car to take my kid to school.",
    "The jury said the election was conducted well.",
    "Return the number of items in the container.",
    "The prime minister defended the budget in parliament yesterday evening.",
    "Redistribution and use in source and binary forms, with or without modification, are permitted.",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tenant_world(tmp_path_factory.mktemp("sched"), tiny_bert(layers=4, hidden=H, vocab=30522))


def tenant_world(tmp, bert):
    """Twelve tenants of the four kinds on ``bert`` (split at L_LOW), their adapters perturbed
    so that no two answer alike, a PLOT computed on demand, and a registered "ghost" tenant
    whose adapter is missing: ``(bert, tokenizer, adapter store, tenants, lookup)`` (``tenants``: a ``FixedTenants``)."""
    tok = load_tokenizer(default_spec().model_dir)
    enc = WindowedEncoder(bert, L_LOW).eval()
    store = PlotStore(tmp / "plot", meta=PlotMeta("tiny", L_LOW, bert.config.hidden_size), readonly=False)
    lookup = PlotLookup([PlotVersion("root", store, enc)], policy="compute+insert")
    adapters = AdapterStore(tmp / "tenants")
    entries = {}
    for i in range(12):
        spec = KINDS[i % len(KINDS)]
        t = tenant_model(bert, L_LOW, spec, seed=i)
        with torch.no_grad():
            for p in t.parameters():
                p.add_(0.2 * torch.randn(p.shape))
        name = f"t{i}"
        adapters.save(name, spec, t.weights())
        entries[name] = TenantEntry(name, spec)
    entries["ghost"] = TenantEntry("ghost", KINDS[0])  # registered but its adapter is missing

    tenants = FixedTenants(entries, lookup)
    return bert, tok, adapters, tenants, lookup


def make(world, **kw):
    bert, tok, adapters, tenants, lookup = world
    return Scheduler(bert, L_LOW, tok, adapters, tenants, tenants, SchedulerConfig(**kw))


def workload(n=40, seed=0):
    rng = random.Random(seed)
    return [(f"t{rng.randrange(12)}", rng.choice(TEXTS)) for _ in range(n)]


def same(a, b):
    if "label" in a:
        assert a["label"] == b["label"]
        for k in a["scores"]:
            assert abs(a["scores"][k] - b["scores"][k]) < 1e-5
    else:
        assert [t["tag"] for t in a["tokens"]] == [t["tag"] for t in b["tokens"]]
        assert [t["token"] for t in a["tokens"]] == [t["token"] for t in b["tokens"]]
