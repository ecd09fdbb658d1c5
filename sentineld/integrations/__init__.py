"""Callbacks for training frameworks: the user adds one callback, nothing else.

- :mod:`sentineld.integrations.lightning`: ``SentineldCallback`` for PyTorch Lightning
  (``lightning.pytorch`` or ``pytorch_lightning``).
- :mod:`sentineld.integrations.transformers`: ``SentineldCallback`` for the Hugging Face Trainer.

Each records, in ``run.json``, what the replay needs to rebuild the run without user code (the
module class and its hyperparameters, or the model class and its config) and names a built-in
recipe (``*_replay:recipe_from_run``) that rebuilds it. Importing this package imports neither
framework.
"""
