"""sentineld.daemon: the service that watches run directories, runs the signatures, alerts, and
spawns ``python -m sentineld.replay``. The training process never imports this package."""
