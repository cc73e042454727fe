"""WAN emulator for tests and benchmarks: namespaces + veth + tbf for bandwidth, a proxy for delay.

    with WanLink(target=("127.0.0.1", port), rate_mbit=20, rtt_ms=50) as link:
        proc = link.site.popen([sys.executable, "-m", "some.client", link.url])

``link.url`` is the proxy's address as seen from inside the site's namespace; traffic from there
crosses the shaped veth, then the delay proxy, then reaches ``target`` on this host's loopback.
"""
from __future__ import annotations

from bench.wanemu.delay import DelayProxy
from bench.wanemu.namespaces import NamespaceUnavailable, Shape, Site, check_available, list_namespaces


class WanLink:
    """A site behind a shaped, delayed link to a TCP service on this host (e.g. the coordinator)."""

    def __init__(self, target: tuple[str, int], rate_mbit: float, rtt_ms: float, cut_after: int | None = None) -> None:
        shape = Shape(rate_mbit)
        self.site = Site(uplink=shape, downlink=shape)
        try:
            self.proxy = DelayProxy(target, rtt_ms / 2000, listen=(self.site.host_ip, 0), cut_after=cut_after)
        except BaseException:
            self.site.close()
            raise

    @property
    def url(self) -> str:
        return self.proxy.url()

    def close(self) -> None:
        self.proxy.close()
        self.site.close()

    def __enter__(self) -> "WanLink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DelayProxy", "NamespaceUnavailable", "Shape", "Site", "WanLink", "check_available", "list_namespaces"]
