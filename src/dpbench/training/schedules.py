"""Learning-rate schedules: the learning rate of step t (t = 0, ..., T - 1 of the T planned
steps) is ``lr * factor(name, t, T)``, set on the update rule before the step, for every
optimizer alike (``apply``). Post-processing of released gradients: no privacy is spent.

* ``constant`` (the default): lr at every step, as every run before schedules;
* ``linear``: lr (1 - t / T), decaying linearly to lr / T at the last planned step (the decay to
  0 of Li, Tramèr, Liang & Hashimoto 2022, "Large Language Models Can Be Strong Differentially
  Private Learners", ICLR 2022, arXiv:2110.05679, who fine-tune with it at large logical batches).

A run capped by ``max_steps`` follows the planned T's schedule (its steps are the first of the
planned run's), and a resumed run continues it from its step count. Standard library only.
"""

from __future__ import annotations

DEFAULT = "constant"
SCHEDULES = {
    "constant": lambda t, steps: 1.0,
    "linear": lambda t, steps: 1.0 - t / steps,
}


def factor(name: str, t: int, steps: int) -> float:
    """The factor of the learning rate at step ``t`` (0-based) of ``steps`` planned steps."""
    if name not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if not 0 <= t < steps:
        raise ValueError(f"step {t} is outside the {steps} planned steps")
    return SCHEDULES[name](t, steps)


def check_rule(rule, optimizer: str) -> None:
    """A rule that a schedule can set: one with a float ``lr`` (every built-in's; a plugin's rule
    without one is refused, naming its optimizer)."""
    if not isinstance(getattr(rule, "lr", None), (int, float)):
        raise ValueError(f"optimizer {optimizer!r}: its update rule {type(rule).__name__} has no learning rate "
                         "`lr` for `lr_schedule` to set")


def apply(rule, lr: float, name: str, t: int, steps: int) -> None:
    """Sets ``rule.lr`` to the schedule's learning rate of step ``t`` (its base is ``lr``)."""
    rule.lr = lr * factor(name, t, steps)
