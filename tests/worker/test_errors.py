"""worker.errors: one root for every error the worker raises on purpose."""
import re

import worker.errors
from worker.checkpoint import CheckpointError
from worker.data import DatasetError
from worker.distributed import DistributedSetupError
from worker.errors import WorkerError
from worker.privacy_floor import PrivacyFloorError

ERRORS = (CheckpointError, DatasetError, DistributedSetupError, PrivacyFloorError)


def test_every_worker_error_has_the_one_root_and_keeps_its_old_bases():
    assert all(issubclass(cls, WorkerError) for cls in ERRORS)
    # callers that caught ValueError for these keep working
    assert issubclass(CheckpointError, ValueError) and issubclass(DistributedSetupError, ValueError)


def test_the_documented_tree_is_the_code():
    documented = set(re.findall(r"[├└]── (\w+)", worker.errors.__doc__))
    assert documented == {cls.__name__ for cls in ERRORS}
