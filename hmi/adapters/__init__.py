"""Per-tenant adapters in the shared upper layers (docs/design.md, section 4)."""
