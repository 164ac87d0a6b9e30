"""The further-pretraining objectives of a domain branch and their defaults (``further_pretrain.FPTConfig``).

Torch-free, so that argument parsing and the HTTP schemas name them without loading a model.
"""

OBJECTIVES = ("distill", "mlm")
DEFAULT_OBJECTIVE = "distill"
DEFAULT_STEPS = {"distill": 600, "mlm": 150}
DEFAULT_LR = {"distill": 3e-4, "mlm": 1e-4}
DEFAULT_BATCH = {"distill": 32, "mlm": 16}


def steps_help() -> str:
    """The default steps per objective, in words (``--steps`` help)."""
    return ", ".join(f"{n} {o}" for o, n in DEFAULT_STEPS.items())
