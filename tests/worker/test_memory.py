"""worker.memory: when activation checkpointing pays, and freed memory going back to the OS."""
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config

from worker.memory import AUTO_CHECKPOINT_ABOVE, activation_bytes, want_checkpointing

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)
TINY = Qwen2Config(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=3000)


def test_auto_checkpoints_smollm2_at_the_default_batch_and_not_the_tiny_model():
    assert activation_bytes(SMOLLM2, 8, 256) == 4 * 8 * 256 * 30 * (10 * 576 + 4 * 1536 + 9 * 256)
    assert want_checkpointing(None, SMOLLM2, 8, 256)
    assert not want_checkpointing(None, SMOLLM2, 1, 64)  # a small batch keeps little
    assert activation_bytes(TINY, 8, 256) < AUTO_CHECKPOINT_ABOVE and not want_checkpointing(None, TINY, 8, 256)


def test_an_explicit_choice_wins_and_an_unknown_shape_is_not_checkpointed():
    assert want_checkpointing(True, TINY, 1, 2) and not want_checkpointing(False, SMOLLM2, 64, 1024)
    assert activation_bytes(object(), 8, 256) is None and not want_checkpointing(None, object(), 8, 256)


FRAGMENT = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
from worker.memory import release_freed_memory
if sys.argv[1] == "release" and not release_freed_memory():
    print("unsupported"); sys.exit()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

libc.free(touched(20 << 20))  # a freed 20 MB mapping: glibc's default raises its mmap threshold to 20 MB
before = rss()
blocks, pins = [], []
for _ in range(10):  # 80 MB of activation-sized blocks, each followed by a smaller one that stays alive
    blocks.append(touched(8 << 20))
    pins.append(touched(256 << 10))
for block in blocks:
    libc.free(block)
print((rss() - before) >> 20)
"""


@pytest.mark.parametrize("mode", ["release", "default"])
def test_freed_blocks_leave_the_process_only_with_the_threshold_fixed(mode):
    out = subprocess.run([sys.executable, "-c", FRAGMENT.format(root=str(ROOT)), mode], capture_output=True,
                         text=True, check=True).stdout.strip()
    if out == "unsupported":
        pytest.skip("not glibc: no mallopt")
    kept_mb = int(out)
    if mode == "release":
        assert kept_mb < 8  # every 8 MB block was its own mapping, unmapped by free
    else:
        assert kept_mb >= 64  # the heap kept them: what a worker's RSS grew by, step after step
