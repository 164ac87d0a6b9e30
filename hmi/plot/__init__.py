"""PLOT: precomputed lookup tables of the windowed lower layers (DESIGN section 2)."""
