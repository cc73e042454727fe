"""The front turns Nagle off on every TCP connection it accepts (coordinator/http/front.py ``open``, ``no_delay``).

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; the coordinator's listening socket is made
with proto 0, so its connections kept Nagle on and every answer's body (a write after the head's) waited for the
client's delayed ACK: 40 ms per request (docs/history/scale.md, seventh round).
"""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from coordinator.http.front import BufferingFront
from coordinator.http.options import FrontOptions
from coordinator.http.wire import Wire


def test_a_socket_made_like_the_coordinators_has_nagle_on_until_the_front_turns_it_off(tmp_path: Path):
    listener = socket.create_server(("127.0.0.1", 0))  # proto 0, as the coordinator's
    front = BufferingFront(lambda environ, start: [], listener, FrontOptions(spool_dir=tmp_path))
    seen: list[tuple[int, int]] = []

    def accepted(wire: Wire) -> None:  # the accepted socket before and after the front's own ``open``
        sock = wire.transport.get_extra_info("socket")
        before = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        front.open(wire)
        seen.append((sock.proto, before, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))

    async def accept_one() -> None:
        front.shared.stopping = asyncio.Event()
        front.shared.stopping.set()  # the connection is served not at all: only what ``open`` does first is checked
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Wire(accepted, front.loop_buffers), sock=listener)
        client = socket.create_connection(listener.getsockname())
        while not seen:
            await asyncio.sleep(0.01)
        client.close()
        server.close()
        await asyncio.gather(*front.connections, return_exceptions=True)

    asyncio.run(accept_one())
    assert seen == [(0, 0, 1)]
