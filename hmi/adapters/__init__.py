"""Per-tenant adapters in the shared upper layers (DESIGN section 4)."""
