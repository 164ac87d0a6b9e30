"""Batches of infer requests through the pipeline R (lookup) -> A (adapter residency) -> C (upper layers)."""
