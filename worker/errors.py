"""The worker's exception tree: one root, so an entry script reports any of them as one line.

    WorkerError
    ├── CheckpointError        (worker.checkpoint; also a ValueError)
    ├── DatasetError           (worker.datasets)
    ├── PrivacyFloorError      (worker.privacy_floor)
    └── DistributedSetupError  (worker.distributed; also a ValueError)

Errors from the coordinator arrive as ``protocol.errors.FedMoEError`` (the client's own tree); a base model
that cannot be loaded raises ``models.errors.ModelError`` (the models package's own tree).
"""


class WorkerError(Exception):
    """Base of every error the worker raises on purpose; its message is meant for the user as is."""
