"""The front turns Nagle off on every TCP connection it accepts (coordinator/front.py ``no_delay``).

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; the coordinator's listening socket is made
with proto 0, so its connections kept Nagle on and every answer's body (a write after the head's) waited for the
client's delayed ACK: 40 ms per request (docs/history/scale.md, seventh round).
"""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from coordinator.front import BufferingFront, FrontOptions


class _Writer:
    """What ``BufferingFront._accept`` asks of a stream writer, around a real accepted socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closed = sock, False

    def get_extra_info(self, name: str):
        return {"socket": self.sock, "peername": self.sock.getpeername(), "sockname": self.sock.getsockname()}.get(name)

    def close(self) -> None:
        self.closed = True


def _accepted_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))  # proto 0, as the coordinator's
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return listener, client, accepted


def test_a_socket_made_like_the_coordinators_has_nagle_on_until_the_front_turns_it_off(tmp_path: Path):
    listener, client, accepted = _accepted_pair()
    try:
        assert accepted.proto == 0 and accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        front = BufferingFront(lambda environ, start: [], listener, FrontOptions(spool_dir=tmp_path))

        async def accept_one() -> None:
            front.stopping = asyncio.Event()
            front.stopping.set()  # the connection is served not at all: only what _accept does first is checked
            await front._accept(asyncio.StreamReader(), _Writer(accepted))  # type: ignore[arg-type]

        asyncio.run(accept_one())
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        for s in (client, accepted, listener):
            s.close()
