"""What a training step holds in memory, and keeping the process's resident size close to it.

Two measures keep a worker small (bench/worker_memory.py has the figures):

- Activation checkpointing where the activations are large: without it a decoder keeps roughly
  10 x hidden + 4 x intermediate float32 values per token and layer (norm outputs, projections,
  the MLP's gate, up and product) plus the attention probabilities, for the backward pass; with it,
  only each layer's input, and one layer's worth is recomputed at a time. ``--gradient-checkpointing
  auto`` turns it on when that estimate passes AUTO_CHECKPOINT_ABOVE: on for smollm2-135m at batch
  8 x 256 (~3.5 GB estimated), off for the tiny test model, where recomputing would only cost time.
- A fixed malloc mmap threshold (``release_freed_memory``): without it glibc keeps freed activation
  memory resident, and a checkpointed smollm2-135m worker peaked at 3.1 GB instead of 1.2 GB.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

AUTO_CHECKPOINT_ABOVE = 512 * 2**20
"""Estimated activation bytes of one micro-batch above which --gradient-checkpointing auto checkpoints."""


def activation_bytes(config: Any, batch_size: int, seq_len: int) -> int | None:
    """Rough float32 bytes a decoder keeps for its backward pass on one [batch_size, seq_len] batch.

    None when the config lacks the usual decoder sizes (then nothing is estimated).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        intermediate, heads = int(config.intermediate_size), int(config.num_attention_heads)
    except (AttributeError, TypeError):
        return None
    per_token = 10 * hidden + 4 * intermediate + heads * seq_len  # the last term: attention probabilities
    return 4 * batch_size * seq_len * layers * per_token


def want_checkpointing(setting: bool | None, config: Any, batch_size: int, seq_len: int) -> bool:
    """--gradient-checkpointing: on (True), off (False), or auto (None): on when activations would pass the bar."""
    if setting is not None:
        return setting
    estimate = activation_bytes(config, batch_size, seq_len)
    if estimate is None or estimate <= AUTO_CHECKPOINT_ABOVE:
        return False
    log.info("activation checkpointing on (--gradient-checkpointing auto): a %d x %d batch would keep ~%.1f GB of "
             "activations for the backward pass", batch_size, seq_len, estimate / 1e9)
    return True


M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number for the mmap threshold (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations from this size up get their own mapping, returned to the OS when freed."""


def release_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc hand large freed blocks back to the OS at once; False where that is not possible.

    glibc serves a request of at least the mmap threshold with its own mapping and unmaps it on free.
    The threshold starts at 128 KiB but rises to the size of every mapped block freed, up to 32 MiB,
    so from the first training step on, activation tensors (5-13 MB each for smollm2-135m at batch
    8 x 256) come from the heap, where freed blocks stay resident and fragment. Setting the threshold
    (mallopt) fixes it and stops the rise. Process-wide: call it once, from the worker's entry point.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
