"""Fixtures for the worker tests."""
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import forkserver

import pytest
import torch
import torch.multiprocessing as mp

from tests import launcher

RANK_MODULES = ["tests.worker.strategy_ranks", "tests.worker.comm_ranks"]


def spawn_ranks(fn: Callable, *args: object, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with the ranks forked from multiprocessing's fork server,
    which imports the rank modules (torch, transformers, peft: ~10 CPU s) once per test process, not once per rank
    as a spawned interpreter does. The fork server only imports, so no OpenMP pool is forked."""
    multiprocessing.set_forkserver_preload(RANK_MODULES)
    before = _fork_server_cpu()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
    launcher.count_cpu(_fork_server_cpu() - before)  # the ranks are its children, not ours (tests/conftest.py's log)


def _fork_server_cpu() -> float:
    """CPU seconds of the fork server and of the ranks it has reaped (which it does before reporting their exit)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as stat:
        utime, stime, cutime, cstime = map(int, stat.read().rsplit(")", 1)[1].split()[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """Run torch single-threaded here, restoring the setting afterwards.

    On a shared 2-core machine torch's OpenMP threads spin-wait when another process takes a core,
    and a 0.04 s training step was measured taking 3.5 s; one thread costs ~0.07 s and stays put.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
