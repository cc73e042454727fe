#!/usr/bin/env python3
"""Serving benchmark: the engine's mixed-expert batches and continuous batching, then serve.py over HTTP.

Engine part (in process, no HTTP): three LoRA experts (rank 8 on all seven projections, random
factors) installed in one GenerationEngine; closed-loop clients (1, 8, 32 by default) each send
their next request when the last one ends, every request generating exactly --max-tokens greedy
tokens. Rows use the base model (no adapter), one expert, three experts by turns, or a 0.7 / 0.3
mixture of two experts; the modes are interleaved in each round (same machine load), the fastest
of --rounds counts. Reported: tokens/s, time to first token p50/p99, and the ratios the serving
target is about (three experts mixed vs one expert, and vs the base model).

HTTP part: a real coordinator (in this process, loopback) holds the three experts with routing
profiles from the sample data; serve.py runs as users start it, in its own process; clients send
chat requests from `--clients` threads: requests/s, tokens/s, p50/p99 latency for 1 expert vs 3
mixed, at --max-batch 1 and the default; the `auto` route's time per prompt; the swap time of a
version pushed during traffic.

    python -m bench.serve                                             # tiny-qwen2, both parts
    python -m bench.serve --base-model smollm2-135m --engine-only --max-tokens 32

Tables on stdout, results in bench/results/serve.json (commit and load average in "stamp").
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from bench.common import format_table, running_coordinator
from bench.harness import Bench, Run, git_head
from protocol.profiles import profile_to_json, text_profile
from protocol.cli import option
from protocol.client import CoordinatorClient
from protocol.tensors import dumps
from serving.routing import LocalRouter
from models.loading import LORA_PROJECTIONS, load_base_model

ROOT = Path(__file__).resolve().parents[1]

EXPERTS = ("python_expert", "sql_expert", "docs_expert")
SERVING = re.compile(r"serving listening on (http://[\d.]+:\d+)")
KEY = "sk-bench-serving"
RANK = 8
REPEATS = 5  # engine runs per setting; the fastest counts (the machine is shared, noise only adds time)
ENGINES = {"max_batch 1": ["--max-batch", "1"], "max_batch 16 (default)": []}
DEFAULT_ENGINE = "max_batch 16 (default)"


def lora_adapter(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_PROJECTIONS:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=g) * scale
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=g) * scale
    return tensors


def prompts_of(expert: str) -> list[str]:
    lines = (ROOT / "data" / f"{expert}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def seed_federation(client: CoordinatorClient, base) -> None:
    spec = {"lora": {"rank": RANK, "alpha": 16.0, "target_modules": list(LORA_PROJECTIONS)},
            "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    for seed, name in enumerate(EXPERTS):
        client.experts.create(name, lora_adapter(base.model, seed), spec)
        prompts = prompts_of(name)
        client.experts.put_profile(name, f"w-{name}", profile_to_json(text_profile(prompts), len(prompts)))


class ServeProcess:
    """serve.py of checkout ``root`` as users start it, on a free loopback port, in front of ``coordinator``."""

    def __init__(self, root: Path, coordinator: str, keys: Path, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, str(root / "serve.py"), "--coordinator-url", coordinator,
                                      "--port", "0", "--api-key-file", str(keys), *flags],
                                     cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if m := SERVING.search(line):
                self.url = m.group(1)
                break
        else:
            raise RuntimeError("serve.py exited before listening:\n" + "".join(self.log[-30:]))
        threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def chat(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                      json={"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - started, r.json()


def run_stream(url: str, models: list[str], prompts: list[str], requests_n: int, clients: int,
               max_tokens: int) -> dict[str, Any]:
    jobs = [(models[i % len(models)], prompts[i % len(prompts)]) for i in range(requests_n)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda job: chat(url, job[0], job[1], max_tokens), jobs))
    wall = time.perf_counter() - started
    latencies = sorted(seconds for seconds, _ in results)
    tokens = sum(body["usage"]["completion_tokens"] for _, body in results)
    return {"requests": requests_n, "seconds": round(wall, 2), "requests_per_s": round(requests_n / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "mean_completion_tokens": round(tokens / requests_n, 1),
            "p50_ms": round(1000 * percentile(latencies, 50)), "p99_ms": round(1000 * percentile(latencies, 99))}


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def local_routing(client: CoordinatorClient, prompts: list[str]) -> dict[str, Any]:
    router = LocalRouter()
    router.update(client.gateway.profiles())
    times = []
    for _ in range(3):
        for prompt in prompts:
            times.append(router.route(prompt, set(EXPERTS)).seconds)
    times.sort()
    return {"prompts": len(times), "p50_us": round(1e6 * percentile(times, 50), 1),
            "p99_us": round(1e6 * percentile(times, 99), 1)}


def measure_swap(url: str, client: CoordinatorClient, base, max_tokens: int, poll: float) -> dict[str, Any]:
    """Push a new python_expert version during traffic; time until a response comes from it."""
    stop, failures, seen = threading.Event(), [], []

    def traffic() -> None:
        while not stop.is_set():
            try:
                seen.append((time.perf_counter(), chat(url, "python_expert", "Sort a list", max_tokens)[1]))
            except Exception as exc:  # counted: a failed request during a swap is what this measures
                failures.append(repr(exc))

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    version = client.experts.get("python_expert")["version"]
    pushed = time.perf_counter()
    client.updates.push("python_expert", dumps(lora_adapter(base.model, 42, 0.01)),
                       {"update_id": f"bench-swap-{time.time()}", "base_version": version, "num_samples": 10,
                        "train_loss": 1.0})
    deadline = pushed + 120
    first = None
    while first is None and time.perf_counter() < deadline:
        first = next((t for t, body in list(seen) if t > pushed and body["fedmoe"]["adapter_version"] > version), None)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join()
    health = requests.get(url + "/health", timeout=10).json()
    return {"poll_interval_s": poll, "push_to_first_new_answer_s": None if first is None else round(first - pushed, 2),
            "server_download_and_install_ms": health["last_swap_ms"], "requests_during_swap": len(seen),
            "failed_requests": len(failures)}


ENGINE_MODES = ("base model", "1 expert", "3 experts mixed", "top-2 mixture")
"""What every row of an engine stream uses: no adapter, one expert, one of three experts by turns, or a
weighted mixture of two experts (0.7 / 0.3, several LoRA deltas in one forward)."""


def engine_streams(base, prompts: list[str], max_tokens: int, clients: tuple[int, ...], rounds: int,
                   max_batch: int) -> dict[str, Any]:
    """The engine alone (no HTTP): closed-loop clients, each sending its next request when the last ends.

    For each client count every mode runs ``rounds`` times, modes interleaved within a round (A/B on one
    machine: the load they see is the same); the round with the most tokens per CPU second of this process
    counts, and the ratios are of tokens per CPU second: with one torch thread that is the work a token
    costs, which other processes on a shared machine do not change (tokens per wall second do, 2.5x from
    round to round at load 16). Every request generates exactly ``max_tokens`` tokens (stop tokens ignored),
    so the modes do the same work.
    """
    from serving.config import EngineOptions

    engine, registry = _engine(base, EngineOptions(max_batch=max_batch))
    engine.stop_ids = frozenset()
    engine.start()
    out: dict[str, Any] = {}
    try:
        for n in clients:
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in ENGINE_MODES}
            for _ in range(rounds):
                for mode in ENGINE_MODES:
                    runs[mode].append(_closed_loop(engine, registry, base.tokenizer, mode, prompts, n, max_tokens))
            best = {mode: max(r, key=lambda x: x["tokens_per_cpu_s"]) for mode, r in runs.items()}
            mixed, one, bare = (best[m]["tokens_per_cpu_s"] for m in ("3 experts mixed", "1 expert", "base model"))
            out[f"{n} clients"] = {"modes": best, "mixed_vs_one_expert": round(mixed / one, 3),
                                   "mixed_vs_base": round(mixed / bare, 3),
                                   "mixture_vs_one_expert": round(best["top-2 mixture"]["tokens_per_cpu_s"] / one, 3),
                                   "all_rounds_tokens_per_s": {m: [x["tokens_per_s"] for x in r] for m, r in runs.items()},
                                   "all_rounds_tokens_per_cpu_s": {m: [x["tokens_per_cpu_s"] for x in r]
                                                                   for m, r in runs.items()}}
            print(f"engine, {n} clients: " + ", ".join(f"{m} {best[m]['tokens_per_cpu_s']} tok/CPU s" for m in ENGINE_MODES)
                  + f"; mixed/one {mixed / one:.2f}, mixed/base {mixed / bare:.2f}", file=sys.stderr, flush=True)
    finally:
        engine.stop()
    return out


def _engine(base, options):
    import copy

    from serving.adapters import AdapterRegistry
    from serving.engine import AdapterWeights, GenerationEngine

    lora = {"rank": RANK, "alpha": 16.0, "target_modules": list(LORA_PROJECTIONS)}
    registry = AdapterRegistry()
    engine = GenerationEngine(copy.deepcopy(base.model), base.tokenizer, registry, options, max_queue=256)
    for seed, name in enumerate(EXPERTS):
        engine.install(AdapterWeights(name, 0, lora_adapter(base.model, seed), lora)).result()
    return engine, registry


def _closed_loop(engine, registry, tokenizer, mode: str, prompts: list[str], clients: int,
                 max_tokens: int) -> dict[str, Any]:
    """``clients`` threads, 2 requests each (at least 4 in all), through the running engine."""
    from serving.engine import BASE_SLOT
    from serving.jobs import END, Job
    from serving.adapters import LoadedAdapter
    from serving.schema import CompletionRequest, Sampling

    total = max(4, 2 * clients)
    counter = iter(range(total))
    lock = threading.Lock()
    finished: list[Any] = []

    def one(i: int) -> Any:
        request = CompletionRequest("text", mode, None, prompts[i % len(prompts)], max_tokens,
                                    Sampling(temperature=0), (), False, False)
        ids = tokenizer(request.prompt)["input_ids"]
        deadline = time.monotonic() + 600
        if mode == "base model":
            return Job(request, ids, LoadedAdapter("base", BASE_SLOT, 0, 0), deadline)
        if mode == "top-2 mixture":
            a, b = registry.pin(EXPERTS[i % 3]), registry.pin(EXPERTS[(i + 1) % 3])
            return Job(request, ids, a, deadline, mixture=((a, 0.7), (b, 0.3)))
        return Job(request, ids, registry.pin(EXPERTS[0] if mode == "1 expert" else EXPERTS[i % 3]), deadline)

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            job = one(i)
            engine.submit(job)
            while job.events.get(timeout=600)[0] != END:
                pass
            finished.append(job)

    started, cpu_started = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    ttft = sorted(job.first_token_at - job.submitted_at for job in finished)
    tokens = sum(len(job.tokens) for job in finished)
    return {"requests": total, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "tokens_per_cpu_s": round(tokens / cpu, 2), "cpu_seconds": round(cpu, 2),
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1)}


def run_stamp() -> dict[str, Any]:
    """The commit and the machine load at one moment of a run (the engine part's start and end)."""
    return {"commit": git_head(ROOT), "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


def render_engine(streams: dict[str, Any]) -> str:
    rows = []
    for label, r in streams["clients"].items():
        for mode, m in r["modes"].items():
            rows.append([label, mode, m["tokens_per_s"], m["tokens_per_cpu_s"], m["ttft_p50_ms"], m["ttft_p99_ms"]])
        rows.append([label, "ratios (per CPU s)", "", f"mixed/one {r['mixed_vs_one_expert']:.2f}",
                     f"mixed/base {r['mixed_vs_base']:.2f}", f"mixture/one {r['mixture_vs_one_expert']:.2f}"])
    return format_table(["engine alone", "rows use", "tokens/s", "tokens/CPU s", "TTFT p50 ms", "TTFT p99 ms"], rows)


@dataclass(frozen=True)
class Settings:
    requests: int = option(48, "requests per stream")
    clients: int = option(8, "concurrent clients")
    max_tokens: int = option(16, "max_tokens of every request")
    threads: int = option(2, "torch threads of the server")
    poll_interval: float = option(1.0, "server poll interval")
    base_model: str = option("tiny-qwen2", "base model preset, e.g. smollm2-135m after `make smollm2`")
    engine_only: bool = option(False, "only the in-process engine part")
    engine_clients: tuple[int, ...] = option((1, 8, 32), "closed-loop client counts of the engine part", nargs="+",
                                             type=int)
    rounds: int = option(2, "interleaved rounds per engine setting; the fastest counts")
    max_batch: int = option(32, "engine rows per forward")

    def __post_init__(self) -> None:
        if min(self.requests, self.clients, self.max_tokens, self.threads, self.rounds, self.max_batch,
               *self.engine_clients) < 1:
            raise ValueError("counts (--requests, --clients, --max-tokens, --threads, --rounds, --max-batch, "
                             "--engine-clients) must be at least 1")


def run(s: Settings, ctx: Run) -> int:
    prompts = [q for name in EXPERTS for q in prompts_of(name)[:8]]
    results: dict[str, Any] = {"benchmark": "serve", "base_model": s.base_model, "streams": {}, "batch_sizes": {}}
    base = load_base_model(s.base_model)
    torch.set_num_threads(s.threads)
    results["engine_streams"] = {"base_model": s.base_model, "max_tokens": s.max_tokens,
                                 "max_batch": s.max_batch, "stamp_before": run_stamp(),
                                 "clients": engine_streams(base, prompts, s.max_tokens, s.engine_clients, s.rounds,
                                                           s.max_batch)}
    results["engine_streams"]["stamp_after"] = run_stamp()
    print(render_engine(results["engine_streams"]))
    if s.engine_only:  # refresh that part of an earlier full run's results
        earlier = json.loads(ctx.out.read_text()) if ctx.out.exists() else {}
        ctx.write(earlier | {"engine_streams": results["engine_streams"]})
        return 0
    with running_coordinator() as coordinator_url, tempfile.TemporaryDirectory() as tmp:
        client = CoordinatorClient(coordinator_url)
        seed_federation(client, base)
        keys = Path(tmp) / "keys"
        keys.write_text(KEY + "\n")
        results["local_routing"] = local_routing(client, prompts)
        for config, flags in ENGINES.items():
            server = ServeProcess(ROOT, coordinator_url, keys, *flags, "--poll-interval", str(s.poll_interval),
                                  "--threads", str(s.threads), "--max-tokens", "256")
            try:
                for label, models in (("1 expert", ["python_expert"]), ("3 experts mixed", list(EXPERTS))):
                    stream = run_stream(server.url, models, prompts, s.requests, s.clients, s.max_tokens)
                    results["streams"][f"{label}, {config}"] = stream
                    print(f"{label}, {config}: {stream}", file=sys.stderr, flush=True)
                results["batch_sizes"][config] = requests.get(server.url + "/health", timeout=10).json()["batches"]
                if config == DEFAULT_ENGINE:
                    served = [chat(server.url, "auto", q, 1)[1]["fedmoe"] for q in prompts]
                    route_ms = sorted(r["route"]["route_ms"] for r in served)
                    results["served_routing"] = {"requests": len(served), "p50_ms": percentile(route_ms, 50),
                                                 "p99_ms": percentile(route_ms, 99)}
                    results["swap"] = measure_swap(server.url, client, base, s.max_tokens, s.poll_interval)
            finally:
                server.stop()
    ctx.write(results)
    rows = [[name, r["requests_per_s"], r["tokens_per_s"], r["p50_ms"], r["p99_ms"], r["mean_completion_tokens"]]
            for name, r in results["streams"].items()]
    print(format_table(["stream", "req/s", "tokens/s", "p50 ms", "p99 ms", "tokens/req"], rows))
    print(f"routing: {results['local_routing']['p50_us']} us p50 / {results['local_routing']['p99_us']} us p99 "
          f"in-process; served auto route p50 {results['served_routing']['p50_ms']} ms")
    print(f"swap: {results['swap']}")
    return 0


BENCH = Bench("serve", tags=("serving",), settings=Settings, run=run,
              quick={"requests": 8, "clients": 2, "max_tokens": 4, "engine_clients": (1, 4), "rounds": 1},
              torch_threads=None)  # the engine part takes --threads
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
