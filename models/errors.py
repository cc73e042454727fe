"""The models package's exception tree: one root, so an entry script reports any of them as one line.

    ModelError
    ├── ModelLoadError  (models.loading)
    └── PresetError     (models.presets, models.pretrained)

run_worker.py reports it as one line beside the worker's own WorkerError; the gateway tool and the server catch ModelLoadError.
"""


class ModelError(Exception):
    """Base of every error this package raises on purpose; its message is meant for the user as is."""
