"""The load benchmark end to end at a tiny size (--quick): schema, nothing lost or duplicated."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.shapes import lora_manifest

ROOT = Path(__file__).resolve().parents[2]


def test_manifest_shapes_follow_the_model_config():
    # Qwen2-0.5B, r=8, per layer: q and o 8*896+896*8, k and v 8*896+128*8, gate and up 8*896+4864*8,
    # down 8*4864+896*8; 24 layers, 14 tensors each.
    manifest = dict(lora_manifest("qwen2-0.5b", 8))
    assert len(manifest) == 24 * 14
    assert sum(a * b for a, b in manifest.values()) == 24 * (2 * 14336 + 2 * 8192 + 3 * 46080) == 4_399_104
    assert manifest["base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"] == (128, 8)
    assert manifest["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == (8, 4864)


def test_quick_run_pushes_everything_once(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "bench.load", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pushes"] == report["acknowledged"] == 16  # 8 workers x 2 rounds
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["errors"] == []
    assert report["server_errors"] == []
    assert report["parameters_per_update"] == 36992  # tiny-qwen2, r=8, all seven projections
    assert 3.5 < 4 * report["parameters_per_update"] / report["body_bytes_per_update"] < 4  # int8 + scales
    lat = report["latency_s"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert report["coordinator_peak_rss_mb"]["processes"] == 1  # one process serves everything (coordinator/http/front.py)
    assert report["coordinator_peak_rss_mb"]["max_process"] > 50
    assert report["front_loop_cpu_s_per_push"] >= 0 and report["front_loop_core_share"] >= 0
    assert report["front_bodies"] == {"thread": 0, "loop": 0}  # tiny bodies stay in memory, read with their head
    assert "lost" in proc.stdout and [p.name for p in tmp_path.iterdir()] == ["load.json"]


def test_quick_open_loop_run_sends_on_schedule_and_loses_nothing(tmp_path):
    out = tmp_path / "open.json"
    proc = subprocess.run([sys.executable, "-m", "bench.load", "--quick", "--mode", "open", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["mode"] == "open"
    assert report["pushes"] == report["acknowledged"] == 16  # --quick: 16 pushes from 8 workers, 1 s apart
    assert report["lost"] == 0 and report["duplicated"] == 0
    assert report["coordinator_cpu_s_per_push"] > 0


def test_stamped_bodies_are_distinct_and_still_decode():
    from bench.loadgen import stamped
    from compression import make_codec
    from compression.wire import decode_update, encode_update
    from bench.shapes import random_tensors

    manifest = lora_manifest("tiny-qwen2", 8)
    body = encode_update(random_tensors(manifest, 1, 1e-3), manifest, make_codec("int8", {}), seed=1)
    a, b = stamped(body, 1, "int8"), stamped(body, 2, "int8")
    assert len({body, a, b}) == 3 and len(a) == len(body)
    assert decode_update(a, manifest, make_codec("int8", {}))  # still a valid update of the same shapes
    assert stamped(body, 5, "int4") is body  # other codecs: sent as they are


def test_pool_bodies_send_the_stamped_bytes_with_their_digest():
    from bench.loadgen import PoolBody, stamped
    from protocol.integrity import digest_header

    body = bytes(range(256)) * 40
    for codec, algorithm in (("int8", "blake3"), ("int8", "sha256"), ("int4", "blake3")):
        pooled = PoolBody(body, codec, algorithm)
        for counter in (1, 7, 123_456):
            parts, digest = pooled.parts(counter)
            sent = b"".join(parts)
            assert sent == stamped(body, counter, codec)  # the bytes the copying generator sent
            assert digest == digest_header(sent, algorithm)  # the digest of all of them, not of the pool's body
    assert b"".join(PoolBody(body, "int8", "blake3").parts(3)[0])[-4:] == bytes([0, 0, 0, 3])
