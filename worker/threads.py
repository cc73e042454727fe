"""A worker's CPU thread budget, so several workers on one machine do not oversubscribe its cores.

Three smollm2-135m workers on 2 cores with torch's default (one thread per core each) trained at
25-45 tokens/s each, against ~240 tokens/s for one worker alone: threads that outnumber cores
spin and evict each other's caches. Giving each worker a share of the cores avoids that.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Read by OpenMP/BLAS when a library first starts its pool (and by child processes)."""


def apply_thread_budget(threads: int | None) -> None:
    """Use at most `threads` CPU threads for torch in this process; None keeps torch's default (all cores).

    Call it before the first tensor work: torch fixes its inter-op pool the first time it is used.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # the inter-op pool already started (e.g. a library used it); intra-op is what counts
        log.debug("inter-op thread pool already running; only the intra-op budget applies")
    log.info("thread budget: %d torch thread(s)", threads)
