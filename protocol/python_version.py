"""The oldest Python the servers run on, checked at start in one readable line.

The HTTP front (coordinator/http/front.py) uses ``asyncio.timeout``, new in Python 3.11; on 3.10 the coordinator, a relay
and serve.py started, said they listened, then failed on their first connection with an AttributeError deep in a
traceback. The README states the same minimum; tests/cli/test_python_version.py keeps the two equal, and fails in CI
when the suite runs on an older interpreter.
"""
from __future__ import annotations

import sys

MINIMUM = (3, 11)
WHY = "the HTTP front uses asyncio.timeout"


def require_supported_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> None:
    """SystemExit (code 2, one ``error:`` line on stderr) on a Python older than MINIMUM."""
    if tuple(version[:2]) < MINIMUM:
        found = ".".join(map(str, version))
        print(f"error: FedMoE needs Python {'.'.join(map(str, MINIMUM))} or newer ({WHY}); this is Python {found}",
              file=sys.stderr)
        raise SystemExit(2)
