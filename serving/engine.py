"""The one thread that owns the model: it loads adapters and generates, never both at once.

Generation is CPU-bound and a 2-core machine gains nothing from two generations at once, so
every request goes through one queue to this thread. Requests waiting together are generated as
one batch, whatever adapter each uses: PEFT runs a LoRA batch with a different adapter per row
(``adapter_names``), computing each adapter's low-rank term on its own rows only. Only requests
with the same sampling settings share a batch (``generate`` takes one config).

Adapter changes (installing a new version, deleting one no request pins) run on this thread too,
between batches, so the model is never modified while it generates.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, \
    StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from gateway.export import ExportError, check_adapter
from serving.adapters import AdapterRegistry, LoadedAdapter
from serving.config import EngineOptions
from serving.errors import Busy
from serving.jobs import BUSY, FAILED, START, Job
from serving.schema import Sampling

log = logging.getLogger(__name__)

PLACEHOLDER = "__placeholder__"  # PEFT needs one adapter to exist; this one (B = 0) is never used


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
                 options: EngineOptions = EngineOptions(), max_queue: int = 64) -> None:
        self.tokenizer = tokenizer
        self.registry = registry
        self.options = options
        self.model = _wrap(model)
        self.stop_ids = frozenset(_stop_ids(model, tokenizer))
        self._jobs: "queue.Queue[Job]" = queue.Queue(maxsize=max_queue)
        self._held: collections.deque[Job] = collections.deque()  # taken, waiting for a batch of their sampling
        self._tasks: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self.batches: collections.Counter[int] = collections.Counter()
        """Batch size -> how many batches of that size ran (for /metrics-like inspection and the bench)."""

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
            for group in self._groups(self._next_batch()):
                self._generate(group)

    def _do_tasks(self) -> None:
        while True:
            try:
                task, future = self._tasks.get_nowait()
            except queue.Empty:
                break
            _run_task(task, future)
        for adapter in self.registry.reapable():
            try:
                self.model.delete_adapter(adapter.slot)
            except Exception:  # a leaked slot costs memory only; the engine thread must live on
                log.exception("could not drop %s v%d", adapter.model, adapter.version)
                continue
            log.info("dropped %s v%d (no request uses it any more)", adapter.model, adapter.version)

    def _install(self, weights: AdapterWeights) -> LoadedAdapter:
        config = _lora_config(weights)
        slot = self.registry.new_slot()
        started = time.perf_counter()
        self.model.add_adapter(slot, config)
        try:
            result = cast(Any, set_peft_model_state_dict(self.model, weights.tensors, adapter_name=slot))  # peft: a bare namedtuple
            missing = [k for k in result.missing_keys if ".lora_" in k and f".{slot}." in k]
            if result.unexpected_keys or missing:
                raise ExportError(f"{weights.model} v{weights.version} does not fit the base model: unexpected "
                                  f"keys {result.unexpected_keys[:3]}, missing {missing[:3]}")
        except Exception:  # a shape mismatch (RuntimeError) as much as a missing key: leave no half slot behind
            self.model.delete_adapter(slot)
            raise
        adapter = LoadedAdapter(weights.model, slot, weights.version, int(config.r))
        self.registry.publish(adapter)
        log.info("serving %s v%d (rank %d), loaded in %.0f ms", weights.model, weights.version, config.r,
                 1000 * (time.perf_counter() - started))
        return adapter

    def _next_batch(self) -> list[Job]:
        """The oldest waiting job plus those that arrive within batch_wait and sample the same way."""
        first = self._held.popleft() if self._held else self._take(0.05)
        if first is None:
            return []
        batch = [first] + self._take_held(first.request.sampling)
        wait_until = time.monotonic() + self.options.batch_wait
        while len(batch) < self.options.max_batch:
            job = self._take(max(0.0, wait_until - time.monotonic()))
            if job is None:
                break
            (batch if job.request.sampling == first.request.sampling else self._held).append(job)
        return [job for job in batch if self._still_wanted(job)]

    def _take(self, timeout: float) -> Job | None:
        try:
            return self._jobs.get(timeout=timeout) if timeout > 0 else self._jobs.get_nowait()
        except queue.Empty:
            return None

    def _take_held(self, sampling: Sampling) -> list[Job]:
        same = [j for j in self._held if j.request.sampling == sampling][: self.options.max_batch - 1]
        for job in same:
            self._held.remove(job)
        return same

    def _still_wanted(self, job: Job) -> bool:
        if job.cancelled:
            job.close("cancelled")
        elif time.monotonic() > job.deadline:  # waited its whole timeout in the queue
            job.events.put((BUSY, "the request waited its whole --timeout for the model; retry later"))
        else:
            return True
        self.registry.unpin(job.adapter)
        return False

    def _groups(self, batch: list[Job]) -> list[list[Job]]:
        """The batch as one generate call (rows of any adapters), or one call per adapter, in arrival order."""
        if self.options.mix_adapters or not batch:
            return [batch] if batch else []
        groups: dict[str, list[Job]] = {}
        for job in batch:
            groups.setdefault(job.adapter.slot, []).append(job)
        return list(groups.values())

    def _generate(self, batch: list[Job]) -> None:
        self.batches[len(batch)] += 1
        for job in batch:
            job.events.put((START, None))
        try:
            with torch.inference_mode():
                self.model.generate(**self._inputs(batch), generation_config=self._config(batch),
                                    streamer=_RowStreamer(batch, self.tokenizer, self.stop_ids),
                                    stopping_criteria=StoppingCriteriaList([_RowsFinished(batch)]),
                                    **self._adapter_choice(batch))
        except Exception as exc:  # a bug, not bad input: fail these requests, keep serving the others
            log.exception("generation failed for a batch of %d", len(batch))
            for job in batch:
                if not job.finished:
                    job.events.put((FAILED, f"generation failed: {type(exc).__name__}"))
                    job.finish_reason = "error"
        finally:
            for job in batch:
                job.close()
                self.registry.unpin(job.adapter)

    def _adapter_choice(self, batch: list[Job]) -> dict[str, Any]:
        """One adapter for the whole batch: make it the active one. Several: name each row's.

        PEFT's per-row path (``adapter_names``) splits every LoRA layer's input by adapter, which
        costs far more than the low-rank term itself on CPU: measured on tiny-qwen2, a batch of 8
        rows of one adapter took 3.1x longer through it than with that adapter active.
        """
        slots = {job.adapter.slot for job in batch}
        if len(slots) == 1:
            self.model.set_adapter(slots.pop())
            return {}
        return {"adapter_names": [job.adapter.slot for job in batch]}

    def _inputs(self, batch: list[Job]) -> dict[str, torch.Tensor]:
        """Left-padded prompts: generated tokens of every row then line up at the right edge."""
        width = max(len(job.prompt_ids) for job in batch)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch],
                            dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask}

    def _config(self, batch: list[Job]) -> GenerationConfig:
        sampling = batch[0].request.sampling
        extra = {} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p}
        return GenerationConfig(max_new_tokens=max(job.request.max_tokens for job in batch),
                                do_sample=not sampling.greedy, eos_token_id=sorted(self.stop_ids),
                                pad_token_id=self.tokenizer.pad_token_id, **extra)


class _RowStreamer(BaseStreamer):
    """Hands each row's new token to its job. The first call carries the prompts: skipped."""

    def __init__(self, batch: list[Job], tokenizer: PreTrainedTokenizerBase, stop_ids: frozenset[int]) -> None:
        self.batch, self.tokenizer, self.stop_ids = batch, tokenizer, stop_ids
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for job, token in zip(self.batch, value.reshape(-1).tolist()):
            job.accept(token, self.tokenizer, self.stop_ids)

    def end(self) -> None:
        pass


class _RowsFinished(StoppingCriteria):
    """A row is done once its job is (stop token, stop sequence, its max_tokens, its deadline)."""

    def __init__(self, batch: list[Job]) -> None:
        self.batch = batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([job.finished for job in self.batch], dtype=torch.bool, device=input_ids.device)


def _run_task(task: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(task())
    except Exception as exc:  # handed to whoever waits on the future
        future.set_exception(exc)


def _wrap(model: PreTrainedModel) -> PeftModel:
    """The base model inside PEFT, with a zero placeholder adapter so that PEFT has one from the start.

    Every parameter gets a fresh copy of its storage first: generating with tiny-qwen2 exactly as
    ``load_base_model`` returns it took 0.9-2.6 s per 16-token request, and 0.07-0.2 s after this
    copy (same process, same load; the cause is not found, the copy is cheap next to loading).
    """
    from worker.models import default_target_modules

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()

    config = LoraConfig(r=1, lora_alpha=1, target_modules=default_target_modules(model)[:1], bias="none",
                        task_type="CAUSAL_LM", init_lora_weights=True, inference_mode=True)
    return get_peft_model(model, config, adapter_name=PLACEHOLDER).eval()


def _lora_config(weights: AdapterWeights) -> LoraConfig:
    config = check_adapter(weights.tensors, weights.lora)
    config.init_lora_weights = False  # every factor is loaded next; skip the random init
    config.inference_mode = True
    return config


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    from gateway.generate import _stop_ids as stop_ids

    return stop_ids(model, tokenizer)
