"""What every connection of one buffering front shares: the application's threads, the body threads and buffers,
the shutdown flag and the counters.

The front (front.py) makes one and hands it to each connection (connection.py) and body receiver (receiving.py), which
therefore need nothing of the front itself: the listening socket and the shutdown sequence stay the front's.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coordinator.http.bodies import BufferBudget
from coordinator.http.options import FrontOptions
from coordinator.http.wsgi import Answer, WsgiApp, call_app

BODY_THREADS = 64  # threads that read a spooled body with blocking receives (read_on_thread); when all are busy, the loop reads


class FrontShared:
    """The application, its request threads and what the connections count together."""

    def __init__(self, app: WsgiApp, options: FrontOptions, scheme: str) -> None:
        self.app, self.options, self.scheme = app, options, scheme
        self.pool = ThreadPoolExecutor(options.threads, thread_name_prefix="fedmoe-request")
        # spooled bodies: the write, the body's digest and a place's own digest (an upload's running one) side by side
        self.hashing = ThreadPoolExecutor(3, thread_name_prefix="fedmoe-hash")
        self.bodies = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="fedmoe-body")
        self.free_body_threads = BODY_THREADS
        self.bodies_read = {"thread": 0, "loop": 0}  # large bodies by who read them (all, or the loop at least part)
        self.buffers = BufferBudget()  # the receive buffers of large bodies and of the body threads
        self.busy = 0  # requests inside the application right now
        self.stopping: asyncio.Event | None = None  # set by the front on SIGTERM or SIGINT

    async def call_app(self, environ: dict[str, Any]) -> Answer:
        self.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, call_app, self.app, environ)
        finally:
            self.busy -= 1

    def shutdown(self) -> None:
        """Stop the thread pools without waiting: requests still queued are dropped."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.hashing.shutdown(wait=False, cancel_futures=True)
        self.bodies.shutdown(wait=False, cancel_futures=True)
