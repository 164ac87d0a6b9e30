"""Training loops above the model and the PLOT: calibration of roots, and the shared fit() loop."""
