"""Configured vs measured: ``python -m bench.wanemu.measure`` checks the emulator's links.

For each profile (the WAN link to the root, the link inside a site) it makes a site, runs
``bench.wanemu.probe`` inside it through the delay proxy to a loopback probe server, and prints
configured vs measured RTT and throughput. Results go to bench/results/wan_link.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from bench.common import format_table
from bench.harness import Bench, Run
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from bench.wanemu.probe import ProbeServer
from protocol.cli import option

PROFILES = {"wan": (20.0, 50.0), "site": (1000.0, 1.0)}
"""name -> (Mbit/s, RTT ms): the issue's link to the root and the link inside a site."""


def measure_profile(rate_mbit: float, rtt_ms: float, transfer_bytes: int) -> dict[str, float]:
    server = ProbeServer()
    try:
        with WanLink(server.address, rate_mbit, rtt_ms) as link:
            host, port = link.proxy.address
            out = subprocess.run(link.site.command([sys.executable, "-m", "bench.wanemu.probe", host, str(port),
                                                    str(transfer_bytes)]),
                                 capture_output=True, text=True, timeout=300, check=True)
            return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.close()


@dataclass(frozen=True)
class Settings:
    mb: int = option(8, "bytes of each bulk transfer, in MiB")

    def __post_init__(self) -> None:
        if self.mb < 1:
            raise ValueError(f"--mb must be at least 1, got {self.mb}")


def run(s: Settings, ctx: Run) -> int:
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows, results = [], {}
    for name, (rate, rtt) in PROFILES.items():
        m = measure_profile(rate, rtt, s.mb << 20)
        results[name] = {"configured_mbit_s": rate, "configured_rtt_ms": rtt, **m}
        rows.append([name, rate, f"{m['download_mbit_s']:.1f}", f"{m['upload_mbit_s']:.1f}", rtt,
                     f"{m['rtt_ms_median']:.1f}"])
    print(format_table(["link", "Mbit/s set", "down Mbit/s", "up Mbit/s", "RTT ms set", "RTT ms median"], rows))
    ctx.write(results)
    return 0


BENCH = Bench("wan_link", tags=("network",), settings=Settings, run=run, quick={"mb": 1}, torch_threads=None)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
