"""sentineld: a watchdog for PyTorch training runs.

Import stays light on purpose: the training process imports ``sentineld.agent``, which must not pull
in the daemon's dependencies (apprise, watchdog).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
