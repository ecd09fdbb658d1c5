"""sentineld.contracts: what the processes agree on, each defined once.

The agent (training process), the daemon and the replay all import from here; nothing here imports
any of them (``tests/contracts/test_import_rules.py`` checks). Torch is imported only by the modules
that move tensors (``capture``, ``rng``, ``recipe``, ``snapshot``); the rest are plain Python.
"""
