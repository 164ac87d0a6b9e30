"""A character tokenizer for tiny encoder roots (calibration and training tests)."""

import torch


class CharTokenizer:
    """A tiny real tokenizer for a tiny model: characters to ids, with [CLS]=1 and [SEP]=2."""

    def __call__(self, texts, truncation=True, max_length=32, padding=True, return_tensors="pt"):
        rows = [[1] + [3 + (ord(c) % 100) for c in t][: max_length - 2] + [2] for t in texts]
        T = max(map(len, rows))
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}
