"""The environment checks advise reports, from the environment axis
(torchaxe/environment/checks.py), under the name existing importers use."""

from torchaxe.environment.checks import EnvironmentCheck, environment_checks, locate

__all__ = ["EnvironmentCheck", "environment_checks", "locate"]
