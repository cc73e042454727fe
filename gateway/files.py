"""The gateway (or an expert) as a single file: .npz or .safetensors, with its info as JSON.

npz layout: one float32 array per adapter tensor, keyed exactly as PEFT names them, plus
``__fedmoe__``, a 0-d unicode array holding the JSON info, so ``np.load(path)`` reads
everything without pickle. safetensors: the same tensors, the JSON under the metadata key
``fedmoe_gateway``.
"""
from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors.torch import save as safetensors_save
from torch import Tensor

NPZ_META_KEY = "__fedmoe__"
SAFETENSORS_META_KEY = "fedmoe_gateway"


def npz_bytes(tensors: Mapping[str, Tensor], info: Mapping[str, Any]) -> bytes:
    arrays = {name: t.detach().cpu().contiguous().numpy() for name, t in tensors.items()}
    arrays[NPZ_META_KEY] = np.array(json.dumps(dict(info)))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub checks **arrays against allow_pickle: bool
    return buf.getvalue()


def safetensors_bytes(tensors: Mapping[str, Tensor], info: Mapping[str, Any]) -> bytes:
    return safetensors_save({k: t.contiguous() for k, t in tensors.items()},
                            metadata={SAFETENSORS_META_KEY: json.dumps(dict(info))})
