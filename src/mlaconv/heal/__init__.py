"""``mlaconv heal``: end-to-end distillation of a converted model towards its source (``distill``: the training;
``run``: a converted folder healed into a new one)."""

from mlaconv.heal.distill import HealOptions
from mlaconv.heal.run import heal

__all__ = ["HealOptions", "heal"]
