#!/usr/bin/env python3
"""Serving benchmark: serve.py answering a mixed request stream, and how fast it follows the federation.

A real coordinator (in this process, loopback) holds three tiny-qwen2 LoRA experts (rank 8 on all
seven projections, random factors) with routing profiles from the sample data; serve.py runs as
users start it, in its own process. Clients send chat requests at a fixed max_tokens, greedy,
from `--clients` threads at once:

- requests/s, completion tokens/s, p50/p99 latency for a stream to 1 expert vs a stream mixed
  over 3 experts, with the engine not batching (--max-batch 1), batching rows of any adapters
  into one call (--max-batch 8, PEFT adapter_names) and batching per adapter (--no-mix-adapters);
- routing overhead: the `auto` route's time per prompt (as the server reports it, and measured
  here on the same LocalRouter over the sample prompts);
- swap time: a new expert version pushed to the coordinator while requests run, until the first
  response comes from it (poll interval included) and the server's own download + install time.

    python -m bench.serve            # quick: tiny-qwen2, ~2-3 min on 2 cores
    python -m bench.serve --requests 96 --max-tokens 32
    python -m bench.serve --base-model smollm2-135m --engine-only   # batching on a pretrained model

Table on stdout, results in bench/results/serve.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import torch

from bench.common import RESULTS_DIR, format_table, running_coordinator, write_json_atomic
from gateway.router import profile_to_json, text_profile
from protocol.client import CoordinatorClient
from protocol.tensors import dumps
from serving.routing import LocalRouter
from worker.models import LORA_PROJECTIONS, load_base_model

ROOT = Path(__file__).resolve().parents[1]

EXPERTS = ("python_expert", "sql_expert", "docs_expert")
SERVING = re.compile(r"serving listening on (http://[\d.]+:\d+)")
KEY = "sk-bench-serving"
RANK = 8
REPEATS = 5  # engine runs per setting; the fastest counts (the machine is shared, noise only adds time)
ENGINES = {"max_batch 1": ["--max-batch", "1"], "max_batch 8 mixed": ["--max-batch", "8"],
           "max_batch 8 per adapter": ["--max-batch", "8", "--no-mix-adapters"]}
DEFAULT_ENGINE = "max_batch 8 mixed"


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
        client.create_expert(name, lora_adapter(base.model, seed), spec)
        prompts = prompts_of(name)
        client.put_profile(name, f"w-{name}", profile_to_json(text_profile(prompts), len(prompts)))


class ServeProcess:
    def __init__(self, coordinator_url: str, keys: Path, flags: list[str], poll: float, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "serve.py"), "--coordinator-url", coordinator_url, "--port", "0",
             "--api-key-file", str(keys), *flags, "--poll-interval", str(poll),
             "--threads", str(threads), "--max-tokens", "256"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if m := SERVING.search(line):
                self.url = m.group(1)
                break
        else:
            raise RuntimeError("serve.py exited:\n" + "".join(self.log[-30:]))
        threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


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
    router.update(client.profiles())
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
    version = client.expert("python_expert")["version"]
    pushed = time.perf_counter()
    client.push_update("python_expert", dumps(lora_adapter(base.model, 42, 0.01)),
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


def engine_batching(base, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """The engine alone (no HTTP): 8 requests queued at once, 1 or 3 adapters, batched or not."""
    from serving.config import EngineOptions

    out = {}
    for label, options in (("one at a time", EngineOptions(max_batch=1)),
                           ("batch of 8, one call", EngineOptions(max_batch=8)),
                           ("batch of 8, one call per adapter", EngineOptions(max_batch=8, mix_adapters=False))):
        for experts in (EXPERTS[:1], EXPERTS):
            seconds, tokens = min(_engine_run(base, options, experts, prompts, max_tokens) for _ in range(REPEATS))
            key = f"{len(experts)} adapter(s), {label}"
            out[key] = {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
            print(f"engine: {key}: {out[key]}", file=sys.stderr, flush=True)
    return out


def _engine_run(base, options, experts, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """(seconds, completion tokens) for 8 requests queued before the engine starts."""
    import copy

    from serving.adapters import AdapterRegistry
    from serving.engine import AdapterWeights, GenerationEngine
    from serving.jobs import END, Job
    from serving.schema import CompletionRequest, Sampling

    lora = {"rank": RANK, "alpha": 16.0, "target_modules": list(LORA_PROJECTIONS)}
    registry = AdapterRegistry()
    engine = GenerationEngine(copy.deepcopy(base.model), base.tokenizer, registry, options)
    for seed, name in enumerate(experts):
        engine.install(AdapterWeights(name, 0, lora_adapter(base.model, seed), lora)).result()
    jobs = []
    for i in range(8):
        request = CompletionRequest("text", experts[i % len(experts)], None, prompts[i], max_tokens,
                                    Sampling(temperature=0), (), False, False)
        jobs.append(Job(request, base.tokenizer(prompts[i])["input_ids"], registry.pin(request.model),
                        time.monotonic() + 600))
        engine.submit(jobs[-1])
    started = time.perf_counter()
    engine.start()
    for job in jobs:
        while job.events.get(timeout=600)[0] != END:
            pass
    seconds = time.perf_counter() - started
    engine.stop()
    return seconds, sum(len(job.tokens) for job in jobs)


def load_note() -> str:
    return f"measured with os.getloadavg() = {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48, help="requests per stream (default: %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server (default: %(default)s)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="server poll interval (default: %(default)s)")
    p.add_argument("--base-model", default="tiny-qwen2",
                   help="base model preset, e.g. smollm2-135m after `make smollm2` (default: %(default)s)")
    p.add_argument("--engine-only", action="store_true", help="only the in-process engine batching part")
    args = p.parse_args(argv)
    prompts = [q for name in EXPERTS for q in prompts_of(name)[:8]]
    results: dict[str, Any] = {"benchmark": "serve", "base_model": args.base_model, "settings": vars(args),
                               "streams": {}, "batch_sizes": {}}
    base = load_base_model(args.base_model)
    if args.threads:
        torch.set_num_threads(args.threads)
    results["engine_batching"] = {"base_model": args.base_model,
                                  "runs": engine_batching(base, prompts, args.max_tokens)}
    if args.engine_only:  # refresh that part of an earlier full run's results
        path = RESULTS_DIR / "serve.json"
        earlier = json.loads(path.read_text()) if path.exists() else {}
        write_json_atomic(path, earlier | {"engine_batching": results["engine_batching"],
                                           "engine_load_note": load_note()})
        return 0
    with running_coordinator() as coordinator_url, tempfile.TemporaryDirectory() as tmp:
        client = CoordinatorClient(coordinator_url)
        seed_federation(client, base)
        keys = Path(tmp) / "keys"
        keys.write_text(KEY + "\n")
        results["local_routing"] = local_routing(client, prompts)
        for config, flags in ENGINES.items():
            server = ServeProcess(coordinator_url, keys, flags, args.poll_interval, args.threads)
            try:
                for label, models in (("1 expert", ["python_expert"]), ("3 experts mixed", list(EXPERTS))):
                    if label == "1 expert" and "--no-mix-adapters" in flags:
                        continue  # one adapter: the same as mixing
                    stream = run_stream(server.url, models, prompts, args.requests, args.clients, args.max_tokens)
                    results["streams"][f"{label}, {config}"] = stream
                    print(f"{label}, {config}: {stream}", file=sys.stderr, flush=True)
                results["batch_sizes"][config] = requests.get(server.url + "/health", timeout=10).json()["batches"]
                if config == DEFAULT_ENGINE:
                    served = [chat(server.url, "auto", q, 1)[1]["fedmoe"] for q in prompts]
                    route_ms = sorted(s["route"]["route_ms"] for s in served)
                    results["served_routing"] = {"requests": len(served), "p50_ms": percentile(route_ms, 50),
                                                 "p99_ms": percentile(route_ms, 99)}
                    results["swap"] = measure_swap(server.url, client, base, args.max_tokens, args.poll_interval)
            finally:
                server.stop()
    results["load_note"] = load_note()
    write_json_atomic(RESULTS_DIR / "serve.json", results)
    print(format_table(["engine alone, 8 queued requests", "seconds", "tokens/s"],
                       [[k, v["seconds"], v["tokens_per_s"]] for k, v in results["engine_batching"]["runs"].items()]))
    rows = [[name, s["requests_per_s"], s["tokens_per_s"], s["p50_ms"], s["p99_ms"], s["mean_completion_tokens"]]
            for name, s in results["streams"].items()]
    print(format_table(["stream", "req/s", "tokens/s", "p50 ms", "p99 ms", "tokens/req"], rows))
    print(f"routing: {results['local_routing']['p50_us']} us p50 / {results['local_routing']['p99_us']} us p99 "
          f"in-process; served auto route p50 {results['served_routing']['p50_ms']} ms")
    print(f"swap: {results['swap']}")
    print(results["load_note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
