"""A slow machine for tests of time limits: each call of a training step's function advances the
clock that ``hmi.timelimit`` reads by one second."""

import hmi.timelimit


def slow_steps(monkeypatch, module, name: str) -> dict:
    """Patches ``module.name`` (called once per step) to take 1 s of the limits' clock; returns
    the count of steps run (``["n"]``, which a test may reset)."""
    clock, steps = {"now": 0.0}, {"n": 0}
    orig = getattr(module, name)

    def slow_step(*args, **kw):
        clock["now"] += 1.0
        steps["n"] += 1
        return orig(*args, **kw)

    monkeypatch.setattr(hmi.timelimit, "_now", lambda: clock["now"])
    monkeypatch.setattr(module, name, slow_step)
    return steps
