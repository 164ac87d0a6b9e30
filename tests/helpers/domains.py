"""A small synthetic domain corpus and a short further-pretraining recipe for domain tests."""

import numpy as np

from hmi.training.further_pretrain import FPTConfig

WORDS = ("the license grants permission to copy modify merge publish distribute sublicense and sell copies "
         "of the software subject to the following conditions warranty liability damages").split()


def corpus(n=600, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(30, 60))) for _ in range(n)]


FAST = FPTConfig(steps=6, batch_size=8, max_len=64, lr=1e-3, eval_lines=16)  # distill, the default objective
# One distillation step on small batches: for tests of what a domain job writes, not of what it learns.
TINY = FPTConfig(steps=1, batch_size=4, max_len=64, lr=1e-3, eval_lines=4)
