"""The end of every multi-process test script: leave the process group together, then exit at once.

CI at c62729c saw rank 0 of ``fsdp_reload.py`` (2 ranks, gloo, torch 2.13) abort with "terminate
called without an active exception" (SIGABRT) after its work was done: its peer had destroyed the
process group and exited while rank 0 was still saving, and a gloo thread was still joinable when
the interpreter ran its exit-time destructors (pytorch/pytorch#179291 describes the same teardown
crash). A barrier first means no rank tears its connections down while a peer still works, and
``os._exit`` after a clean ``destroy_process_group`` skips the finalization where the abort happens;
everything the test reads was written (and flushed) before.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave() -> NoReturn:
    """Barrier, destroy the default process group, flush stdio and end this rank with exit code 0."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
