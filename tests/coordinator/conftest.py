import pytest

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig


@pytest.fixture
def make_app(tmp_path):
    """Build a coordinator app on a data dir under tmp_path; same dir again = a restart."""
    apps = []

    def make(**overrides):
        overrides.setdefault("data_dir", tmp_path / "data")
        overrides.setdefault("gateway_interval", 0)  # rebuild the gateway at once after each change
        app = create_app(CoordinatorConfig(**overrides))
        app.config["TESTING"] = True
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["fedmoe"].close()


@pytest.fixture
def client(make_app):
    return make_app().test_client()
