"""``sentineld regress``: turn a captured incident into a permanent pytest regression test."""
