"""Audit finding: a checkpoint.json of the right format whose fields had other shapes (hand-edited, from another
tool, or an older run's) ended ``run_worker.py`` in a traceback (KeyError 'identity', TypeError, AttributeError)
instead of the one line that names --fresh. Sent: checkpoint.json of a real tiny-qwen2 run with one field changed
as below. Came back: exit 1 and a traceback. Fix: worker/checkpoint.py (``_manifest_problem``, checked on read).
"""
from __future__ import annotations

import json

import pytest

from tests.worker.test_checkpoint import IDENTITY, checkpoint, trained_adamw
from worker.checkpoint import MANIFEST, CheckpointError, load_checkpoint, save_checkpoint


def _damage(manifest: dict, case: str) -> None:
    if case == "no identity":
        del manifest["identity"]
    elif case == "identity a number":
        manifest["identity"] = 5
    elif case == "no progress":
        del manifest["progress"]
    elif case == "aliases a list":
        manifest["aliases"] = ["x"]
    elif case == "tensors a string":
        manifest["tensors"] = "adapter"
    elif case == "outbox file a number":
        manifest["outbox"] = [{"file": 5, "meta": {"update_id": "w1-aa"}}]
    elif case == "outbox file outside":
        manifest["outbox"] = [{"file": "../../x", "meta": {"update_id": "w1-aa"}}]
    elif case == "directory outside":
        manifest["directory"] = "../../../etc"
    elif case == "a counter a string":
        manifest["progress"]["global_step"] = "many"
    elif case == "data position a string":
        manifest["progress"]["data_position"] = "x"
    elif case == "data position without index":
        manifest["progress"]["data_position"] = {"epoch": 1}


CASES = ["no identity", "identity a number", "no progress", "aliases a list", "tensors a string",
         "outbox file a number", "outbox file outside", "directory outside", "a counter a string",
         "data position a string", "data position without index"]


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_of_the_wrong_shape_is_one_clear_error(tmp_path, case):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    _damage(manifest, case)
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, IDENTITY)

    message = str(err.value)
    assert message.startswith(f"--state-dir {tmp_path}: ") and message.endswith("pass --fresh to discard it")
    assert "\n" not in message


def test_an_intact_manifest_still_loads(tmp_path):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt, [(b"u", {"update_id": "w1-aa"})]))

    loaded = load_checkpoint(tmp_path, IDENTITY)

    assert loaded is not None and loaded.outbox == [(b"u", {"update_id": "w1-aa"})]
    assert loaded.progress["data_position"] == {"epoch": 1, "index": 4}
