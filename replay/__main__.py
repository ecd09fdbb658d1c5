"""``python -m sentineld.replay RUN [--step N] [--json]``: the daemon runs this with the run's
own interpreter and working directory. Same options and exit codes as ``sentineld replay``."""

from sentineld.cli import replay_main

if __name__ == "__main__":
    replay_main()
