"""``python -m sentineld`` runs the command line."""

from sentineld.cli import main

main()
