"""``python -m sentineld.replay RUN [--step N] [--json]``: the daemon runs this with the run's
own interpreter and working directory. Same options and exit codes as ``sentineld replay``."""

from sentineld.replay.main import main

if __name__ == "__main__":
    main()
