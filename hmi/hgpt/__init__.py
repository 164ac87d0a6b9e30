"""hGPT: decoder tenants on a windowed decoder root (causal PLOT, per-tenant LoRA, batched generation)."""
