"""FedMoE compression: codecs for LoRA deltas, update framing and error feedback.

Typical use::

    codec = make_codec("topk+int8", {"topk": {"ratio": 0.01}})
    payload = encode_update(tensors, manifest, codec, seed=step)
    tensors = decode_update(payload, manifest, codec)
"""
from compression.base import Codec, PayloadStats
from compression.error_feedback import ErrorFeedback
from compression.errors import CompressionError, PayloadError
from compression.metrics import measure
from compression.pipeline import Pipeline
from compression.registry import CODECS, make_codec
from compression.wire import Manifest, UpdateStats, decode_update, encode_update, inspect_update

__all__ = [
    "CODECS",
    "Codec",
    "CompressionError",
    "ErrorFeedback",
    "Manifest",
    "PayloadError",
    "PayloadStats",
    "Pipeline",
    "UpdateStats",
    "decode_update",
    "encode_update",
    "inspect_update",
    "make_codec",
    "measure",
]
