"""PLOT: precomputed lookup tables of the windowed lower layers (docs/design.md, section 2)."""
