"""Benchmarks, each a module run as ``python -m bench.<name>`` from the repository root.

Every benchmark prints a table and writes ``bench/results/<name>.json``; ``bench.common`` holds
what they share. Importing the package first sets the environment every benchmark wants before
transformers is imported: offline hub, no progress bars, quiet tokenizers.
"""
import os

for _var, _value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                     ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
    os.environ.setdefault(_var, _value)
