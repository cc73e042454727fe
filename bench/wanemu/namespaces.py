"""Emulated sites: a network namespace joined to this one by a veth pair, shaped with ``tc tbf``.

Why tbf and not netem: the kernels these tests run on have ``tbf`` and ``htb`` but no ``netem``
(nor ``fq``/``fq_codel``/``prio``), so bandwidth is shaped in the kernel and latency is added by
``bench.wanemu.delay.DelayProxy`` in userspace. Every namespace and veth made here is recorded
and removed on ``close()``, on leaving the ``with`` block, and at interpreter exit (atexit), so
a failing test or a Ctrl-C never leaves one behind. Traffic only ever goes between this host's
namespace and the namespaces created here.
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "fwan"
"""Namespace and interface names start with this (and the creating pid), so leftovers are easy to spot."""
SUBNET_POOL = ipaddress.IPv4Network("10.77.0.0/16")

_lock = threading.Lock()
_counter = itertools.count()
_live: dict[str, "Site"] = {}


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``/``tc``, or EPERM)."""


@dataclass(frozen=True)
class Shape:
    """Bandwidth shaping of one direction of a link (``tc qdisc ... tbf``)."""

    rate_mbit: float
    """Token rate in Mbit/s."""
    burst_kb: int = 64
    """Bucket size in KiB; at least one GSO super-packet (64 KiB) or tbf drops it."""
    queue_ms: int = 200
    """Longest a packet may wait in the tbf queue before it is dropped."""

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kb}kb", "latency", f"{self.queue_ms}ms"]


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NamespaceUnavailable(f"{' '.join(args)} failed: {result.stderr.strip() or result.returncode}")
    return result


def check_available() -> None:
    """Raise NamespaceUnavailable with one readable reason when namespaces cannot be used here."""
    if os.name != "posix" or os.geteuid() != 0:
        raise NamespaceUnavailable("network namespaces need root (run as root or in a privileged container)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NamespaceUnavailable(f"the '{tool}' command is missing (install iproute2)")
    remove_stale()
    probe = f"{PREFIX}{os.getpid()}probe"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        raise NamespaceUnavailable(f"cannot create a network namespace: {result.stderr.strip()}")
    _run(["ip", "netns", "del", probe], check=False)


def list_namespaces() -> set[str]:
    """Names of the network namespaces that exist now (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def remove_stale() -> list[str]:
    """Delete namespaces of ours whose creating process is gone (e.g. it was killed with -9)."""
    stale = []
    for name in list_namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)(s\d+|probe)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", name], check=False)
            stale.append(name)
    if stale:
        log.warning("removed %d namespace(s) left by dead processes: %s", len(stale), ", ".join(sorted(stale)))
    return stale


def _exit_on_sigterm() -> None:
    """SIGTERM's default action skips atexit; turn it into SystemExit so the namespaces still go."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run(["ip", "-4", "-o", "addr"], check=False).stdout
    start = (os.getpid() * 13) % 16384
    subnets = list(SUBNET_POOL.subnets(new_prefix=30))
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if f" {net[1]}/" not in used and f" {net[2]}/" not in used:
            return net
    raise NamespaceUnavailable(f"no free /30 left in {SUBNET_POOL}")


class Site:
    """A namespace joined to the host by a veth pair: ``host_ip`` here, ``site_ip`` inside.

    ``uplink`` shapes traffic leaving the site (site -> host), ``downlink`` traffic entering it.
    """

    def __init__(self, uplink: Shape | None = None, downlink: Shape | None = None) -> None:
        _exit_on_sigterm()
        with _lock:
            n = next(_counter)
            self.name = f"{PREFIX}{os.getpid()}s{n}"
            net = _free_subnet()
            _live[self.name] = self
        self.host_dev, self.site_dev = f"{PREFIX}{os.getpid() % 100000}h{n}", f"{PREFIX}{os.getpid() % 100000}s{n}"
        self.host_ip, self.site_ip = str(net[1]), str(net[2])
        try:
            self._create(net.prefixlen, uplink, downlink)
        except BaseException:
            self.close()
            raise

    def _create(self, prefix: int, uplink: Shape | None, downlink: Shape | None) -> None:
        _run(["ip", "netns", "add", self.name])
        _run(["ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.site_dev])
        _run(["ip", "link", "set", self.site_dev, "netns", self.name])
        _run(["ip", "addr", "add", f"{self.host_ip}/{prefix}", "dev", self.host_dev])
        _run(["ip", "link", "set", self.host_dev, "up"])
        _run(["ip", "-n", self.name, "addr", "add", f"{self.site_ip}/{prefix}", "dev", self.site_dev])
        _run(["ip", "-n", self.name, "link", "set", self.site_dev, "up"])
        _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        if downlink is not None:
            _run(["tc", "qdisc", "add", "dev", self.host_dev, "root", *downlink.tc_args()])
        if uplink is not None:
            _run(["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", self.site_dev, "root",
                  *uplink.tc_args()])
        log.info("site %s: %s <-> %s (up %s, down %s)", self.name, self.host_ip, self.site_ip, uplink, downlink)

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command line that runs inside this site's namespace."""
        return ["ip", "netns", "exec", self.name, *args]

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a process inside the namespace (the caller owns and stops it)."""
        return subprocess.Popen(self.command(args), **kwargs)

    def close(self) -> None:
        """Delete the namespace; the kernel removes its veth end, and with it the host end."""
        with _lock:
            _live.pop(self.name, None)
        _run(["ip", "netns", "del", self.name], check=False)
        _run(["ip", "link", "del", self.host_dev], check=False)  # only if the namespace never got it

    def __enter__(self) -> "Site":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for site in list(_live.values()):
        site.close()
