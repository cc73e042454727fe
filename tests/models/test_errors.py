"""models.errors: one root for every error the models package raises on purpose."""
import re

import models.errors
from models.errors import ModelError
from models.loading import ModelLoadError
from models.presets import PresetError

ERRORS = (ModelLoadError, PresetError)


def test_every_model_error_has_the_one_root_and_the_tree_is_documented():
    assert all(issubclass(cls, ModelError) for cls in ERRORS)
    assert set(re.findall(r"[├└]── (\w+)", models.errors.__doc__)) == {cls.__name__ for cls in ERRORS}
