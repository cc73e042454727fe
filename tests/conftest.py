"""Test-wide settings: never reach a model hub, keep output quiet, keep credentials to ourselves."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Coordinators started by tests record their admin token for local clients (protocol.credentials);
# keep those entries in a directory of this test run, inherited by the processes it spawns.
if "FEDMOE_CONFIG_DIR" not in os.environ:
    os.environ["FEDMOE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="fedmoe-test-config-")
    atexit.register(shutil.rmtree, os.environ["FEDMOE_CONFIG_DIR"], True)
