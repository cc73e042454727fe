"""The dashboard in a real headless Chromium, against a live coordinator with two experts and a worker.

Chromium renders the page from loopback (it has no other network: the flags below switch off
everything it would fetch by itself), runs the page's script, and hands back the rendered DOM and a
screenshot (saved to artifacts/dashboard.png). ``make test`` installs Chromium from Debian's
packages when it is missing and sets FEDMOE_REQUIRE_BROWSER=1, so there a missing browser fails;
a bare ``pytest`` on a machine without one skips this file.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from protocol.client import CoordinatorClient
from protocol.credentials import local_token
from protocol.tensors import dumps
from tests.e2e.conftest import ROOT, admin_headers
from tests.helpers import expert_spec, make_adapter, random_like, update_meta

ARTIFACTS = ROOT / "artifacts"
EXPERTS = ("python_expert", "sql_expert")
LOSSES = (3.0, 2.5, 2.25, 2.0)  # the train_loss each push reports: version i+1 carries LOSSES[i]


def chromium() -> str:
    found = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if found is None:
        if os.environ.get("FEDMOE_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium is not installed; `make test` installs it (apt-get install -y chromium)")
        pytest.skip("Chromium is not installed (make test installs it)")
    return found


def render(url: str, screenshot: Path, profile: Path) -> str:
    """The page's DOM after its script ran, and a screenshot, from one headless Chromium run."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1280,900", "--virtual-time-budget=5000",
           f"--screenshot={screenshot}", "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Page(HTMLParser):
    """Cell texts per table row (by table id), and the loss charts' attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self.charts: dict[str, dict[str, str]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._chart: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
        elif tag == "tr" and self._table:
            self.rows.setdefault(self._table, []).append([])
        elif tag == "td" and self._table:
            self._cell = []
        elif tag == "svg" and "loss-chart" in a.get("class", ""):
            self._chart = self.charts.setdefault(a["data-expert"], dict(a))
        elif tag == "polyline" and self._chart is not None:
            self._chart["polyline"] = a.get("points", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table:
            self.rows[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "svg":
            self._chart = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None and self._chart is None:
            self._cell.append(data)


def counters(url: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{url}/metrics", headers=admin_headers(url), timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_dashboard_renders_experts_workers_and_loss_charts(start_coordinator, tmp_path):
    chromium()  # skip (or fail under make test) before starting anything
    _, url = start_coordinator()
    client = CoordinatorClient(url)
    adapter = make_adapter()
    client.workers.register("worker-a", EXPERTS[0], expert_spec()["base_model"], 5.0)
    for name in EXPERTS:
        client.experts.create(name, adapter, expert_spec())
    before = counters(url)
    for version, loss in enumerate(LOSSES):
        client.updates.push(EXPERTS[0], dumps(random_like(adapter, version)),
                           update_meta(base_version=version, worker_id="worker-a", train_loss=loss))
    client.updates.push(EXPERTS[1], dumps(random_like(adapter, 9)), update_meta(train_loss=1.5))
    client.workers.heartbeat("worker-a")
    after = counters(url)
    accepted = ("fedmoe_updates_total", (("expert", EXPERTS[0]), ("outcome", "accepted")))
    assert after[accepted] - before.get(accepted, 0) == len(LOSSES)
    assert after[("fedmoe_expert_version", (("expert", EXPERTS[0]),))] == len(LOSSES)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    page = Page()
    page.feed(render(f"{url}/#token={local_token(url)}", shot, tmp_path / "chromium-profile"))

    experts = {row[0]: row for row in page.rows["experts"] if row}
    assert set(experts) == set(EXPERTS)
    assert experts[EXPERTS[0]][1] == str(len(LOSSES)) and experts[EXPERTS[1]][1] == "1"  # versions
    python_chart = page.charts[EXPERTS[0]]
    assert python_chart["data-points"] == str(len(LOSSES))  # one point per version with a loss
    assert len(python_chart["polyline"].split()) == len(LOSSES)
    first, last = (float(p.split(",")[1]) for p in python_chart["polyline"].split()[::len(LOSSES) - 1])
    assert first < last  # SVG y grows downwards: the falling loss ends lower on the chart
    assert page.charts[EXPERTS[1]]["data-points"] == "1"
    workers = {row[0]: row for row in page.rows["workers"] if row}
    assert workers["worker-a"][1:3] == [EXPERTS[0], "alive"]
    assert any("weighted_average" in cell for row in page.rows["gateway"] for cell in row)
    events = requests.get(f"{url}/api/v1/events?limit=20", headers=admin_headers(url), timeout=10)
    shown = [row for row in page.rows["events"] if row]
    if events.status_code == 404:  # a coordinator without the audit log (branch robust not merged)
        assert shown == [["no events"]]
    else:
        newest = events.json()["events"][0]
        assert shown[0][1] == newest["kind"] and shown[0][4] == newest["message"]
    width, height = png_size(shot)
    assert (width, height) == (1280, 900)
