"""The one thread that owns the model: it loads adapters and generates, never both at once.

Generation is CPU-bound and a 2-core machine gains nothing from two generations at once, so
every request goes through one queue to this thread, which runs one continuously batched
generation (serving/decode.py): between two decode steps, requests that arrived join the running
batch (up to ``max_batch`` rows) and rows that finished leave it, so a request never waits for
another's last token. Rows of any adapters, of a mixture of adapters, or of the base model share
every forward: each adapted layer adds every row's own low-rank term from stacked factors
(serving/batched_lora.py). Each row samples with its own settings.

Adapter changes (installing a new version, deleting one no request pins) run on this thread too,
between two decode steps, so the model is never modified while it generates.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.adapters import AdapterRegistry, LoadedAdapter
from serving.batched_lora import AdapterBank
from serving.config import EngineOptions
from serving.decode import Row, RunningBatch, pick_tokens
from serving.errors import Busy
from serving.jobs import BUSY, FAILED, START, Job

log = logging.getLogger(__name__)

IDLE_WAIT = 0.05
"""Seconds the idle engine waits for a request before it looks at its tasks again."""


@dataclass(frozen=True)
class AdapterWeights:
    """A fully downloaded adapter, ready to install."""

    model: str
    version: int
    tensors: dict[str, torch.Tensor]
    lora: dict[str, Any]
    """{"rank", "alpha", "target_modules"} as the coordinator stores it."""


class GenerationEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, registry: AdapterRegistry,
                 options: EngineOptions = EngineOptions(), max_queue: int = 64, seed: int = 0,
                 bank: AdapterBank | None = None) -> None:
        """``bank``: the model's AdapterBank when adapters are installed already (``model`` is then its model)."""
        self.tokenizer = tokenizer
        self.registry = registry
        self.options = options
        self.bank = bank or AdapterBank(_fresh_storage(model).eval())
        self.model = self.bank.model
        self.stop_ids = frozenset(_stop_ids(model, tokenizer))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._batch = RunningBatch(self.model, self.bank, int(pad))
        self._running: list[Job] = []
        self._next: list[int] = []
        """The token each running row feeds at the next step (picked from its last logits)."""
        self._generator = torch.Generator().manual_seed(seed)
        self._jobs: "queue.Queue[Job]" = queue.Queue(maxsize=max_queue)
        self._tasks: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self.batches: collections.Counter[int] = collections.Counter()
        """Rows per forward -> how many forwards (prefills and decode steps) ran with that many rows."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)

    # called from other threads ------------------------------------------------

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Busy(f"the server already has {self._jobs.maxsize} requests waiting; retry shortly",
                       headers={"Retry-After": "1"}) from None

    def install(self, weights: AdapterWeights) -> Future:
        """Load ``weights`` as a new slot and publish it, on the engine thread; the future holds the adapter."""
        return self._call(lambda: self._install(weights))

    def _call(self, task: Callable[[], Any]) -> Future:
        future: Future = Future()
        if not self._thread.is_alive():  # before start() (or after stop()) run it here: nothing generates
            _run_task(task, future)
        else:
            self._tasks.put((task, future))
        return future

    # engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._do_tasks()
            self._admit()
            if self._running:
                self._decode()
        for job in self._running:  # stopped mid-generation: end the rows rather than leave clients waiting
            self._finish(job)

    def _do_tasks(self) -> None:
        while True:
            try:
                task, future = self._tasks.get_nowait()
            except queue.Empty:
                break
            _run_task(task, future)
        for adapter in self.registry.reapable():
            self.bank.remove(adapter.slot)
            log.info("dropped %s v%d (no request uses it any more)", adapter.model, adapter.version)

    def _install(self, weights: AdapterWeights) -> LoadedAdapter:
        slot = self.registry.new_slot()
        started = time.perf_counter()
        rank = self.bank.install(slot, weights.tensors, weights.lora)
        adapter = LoadedAdapter(weights.model, slot, weights.version, rank)
        self.registry.publish(adapter)
        log.info("serving %s v%d (rank %d), loaded in %.0f ms", weights.model, weights.version, rank,
                 1000 * (time.perf_counter() - started))
        return adapter

    def _admit(self) -> None:
        """Prefill the requests waiting (up to the free rows) and add them to the running batch."""
        free = self.options.max_batch - len(self._running)
        if free <= 0:
            return
        jobs = self._take(free, wait=not self._running)
        jobs = [job for job in jobs if self._still_wanted(job)]
        if not jobs:
            return
        for job in jobs:
            job.events.put((START, None))
        self.batches[len(jobs)] += 1
        try:
            with torch.inference_mode():
                logits = self._batch.join([_row(job) for job in jobs], [job.prompt_ids for job in jobs])
        except Exception as exc:  # a bug, not bad input: fail these requests, keep the running ones
            self._fail(jobs, exc)
            return
        self._running += jobs
        self._next += self._accept(jobs, logits)
        self._drop_finished()

    def _take(self, n: int, wait: bool) -> list[Job]:
        """Up to ``n`` waiting jobs. Idle (``wait``): block for the first, then give others batch_wait to join."""
        jobs: list[Job] = []
        if wait:
            try:
                jobs.append(self._jobs.get(timeout=IDLE_WAIT))
            except queue.Empty:
                return []
            deadline = time.monotonic() + self.options.batch_wait
            while len(jobs) < n and (left := deadline - time.monotonic()) > 0:
                try:
                    jobs.append(self._jobs.get(timeout=left))
                except queue.Empty:
                    break
        while len(jobs) < n:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _decode(self) -> None:
        """One decode step for every running row."""
        self.batches[len(self._running)] += 1
        try:
            with torch.inference_mode():
                logits = self._batch.step(self._next)
        except Exception as exc:  # a bug: fail the running requests, start afresh
            running = self._running
            self._running, self._next = [], []
            self._batch.keep([])
            self._fail(running, exc)
            return
        self._next = self._accept(self._running, logits)
        self._drop_finished()

    def _accept(self, jobs: list[Job], logits: torch.Tensor) -> list[int]:
        tokens = pick_tokens(logits, [job.request.sampling for job in jobs], self._generator)
        for job, token in zip(jobs, tokens):
            job.accept(token, self.tokenizer, self.stop_ids)
        return tokens

    def _drop_finished(self) -> None:
        keep = [i for i, job in enumerate(self._running) if not job.finished]
        for job in self._running:
            if job.finished:
                self._finish(job)
        self._batch.keep(keep)
        self._running = [self._running[i] for i in keep]
        self._next = [self._next[i] for i in keep]

    def _finish(self, job: Job) -> None:
        job.close()
        for adapter in job.pinned:
            self.registry.unpin(adapter)

    def _fail(self, jobs: list[Job], exc: Exception) -> None:
        log.error("generation failed for %d request(s)", len(jobs), exc_info=exc)
        for job in jobs:
            if not job.finished:
                job.events.put((FAILED, f"generation failed: {type(exc).__name__}"))
                job.finish_reason = "error"
            self._finish(job)

    def _still_wanted(self, job: Job) -> bool:
        if job.cancelled:
            job.close("cancelled")
        elif time.monotonic() > job.deadline:  # waited its whole timeout in the queue
            job.events.put((BUSY, "the request waited its whole --timeout for the model; retry later"))
        else:
            return True
        for adapter in job.pinned:
            self.registry.unpin(adapter)
        return False


def _row(job: Job) -> Row:
    return Row(tuple((a.slot, w) for a, w in job.mixture_weights if a.slot != BASE_SLOT), job.request.sampling)


BASE_SLOT = ""
"""The slot of the base model itself (no adapter): a LoadedAdapter with it adds no low-rank term."""


def _run_task(task: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(task())
    except Exception as exc:  # handed to whoever waits on the future
        future.set_exception(exc)


def _fresh_storage(model: PreTrainedModel) -> PreTrainedModel:
    """The model with a fresh copy of every parameter's storage.

    Generating with tiny-qwen2 exactly as ``load_base_model`` returns it took 0.9-2.6 s per 16-token
    request, and 0.07-0.2 s after this copy (same process, same load; the cause is not found, the copy
    is cheap next to loading).
    """
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()
    return model


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    from gateway.generate import _stop_ids as stop_ids

    return stop_ids(model, tokenizer)
