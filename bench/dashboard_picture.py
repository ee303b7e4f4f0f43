"""Draw the Grafana dashboard's panels from a real demo run: `python -m bench.dashboard_picture`.

What an operator sees, for README: `kvrouter demo --keep-running` runs (fake workers, a
round-robin pair of replicas, a cache-aware pair, a third replica that bootstraps from its
siblings), a real Prometheus (Debian's binary, as the tests use it) scrapes every replica and
worker once a second from the moment the demo prints their URLs, and when the demo's checks
are done, every panel of manifests/observability/dashboard.json is evaluated over the run
with its own queries (`query_range`, the dashboard's variables bound to "All") and drawn
with matplotlib, one subplot per panel, legends as the panel's `legendFormat` with replicas
and workers named as the demo names them. Writes docs/dashboard.png (`--out` to change).

The demo runs a longer workload than its default (`DEMO_ARGS`), and three faults are
injected through the fake workers' controls: a worker failing two requests while the third
replica joins, then a batch replay repairs and a seq nothing repairs, so the failover, replay
and lost-batch panels show what they are for. The demo has no Kubernetes discovery: that
panel stays empty.

Needs the `bench` extra (matplotlib) and Debian's prometheus package (scripts/test installs
both). Takes about as long as the demo (a minute on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from bench.plots import pyplot
from tests.support.processes import Processes, kvrouter_argv
from tests.support.prometheus import Prometheus, running_prometheus

REPO: Final = Path(__file__).resolve().parents[1]
DASHBOARD: Final = REPO / "manifests" / "observability" / "dashboard.json"
OUT: Final = REPO / "docs" / "dashboard.png"
DEMO_WITHIN_S: Final = 300.0
TAIL_S: Final = 5.0  # scrapes after the demo's checks, so the last rates settle
# A longer workload than the demo's default, so the rates have a minute to show.
DEMO_ARGS: Final = ("--keep-running", "--conversations", "64", "--turns", "5")
COLUMNS: Final = 4
MAX_LINES: Final = 8  # per panel: the legend stays readable
# `  worker w1  http://127.0.0.1:40123  dp ranks 1`, `  router ca-a  http://...  --policy`,
# `third replica ca-c http://...: kvrouter serve ...`
_WORKER: Final = re.compile(r"^\s+worker (\S+)\s+(http://\S+)")
_ROUTER: Final = re.compile(r"^\s+router (\S+)\s+(http://\S+)")
_JOINING: Final = re.compile(r"^third replica (\S+) (http://[^:]+:\d+):")
_DONE: Final = "the cluster keeps running"


def names_in(output: str) -> tuple[dict[str, str], dict[str, str]]:
    """The demo's routers and workers so far: URL -> name, each."""
    routers: dict[str, str] = {}
    workers: dict[str, str] = {}
    for line in output.splitlines():
        if m := _WORKER.match(line):
            workers[m.group(2)] = m.group(1)
        elif m := _ROUTER.match(line) or _JOINING.match(line):
            routers[m.group(2)] = m.group(1)
    return routers, workers


def legend(fmt: str, labels: dict[str, str], names: dict[str, str]) -> str:
    """Grafana's `{{label}}` substitution, with host:port and URLs named as the demo does."""

    def one(match: re.Match[str]) -> str:
        value = labels.get(match.group(1).strip(), "")
        return names.get(value, value)

    return re.sub(r"\{\{([^}]+)\}\}", one, fmt).strip() or "value"


async def _post(prom: Prometheus, url: str, body: dict[str, Any]) -> None:
    async with prom.session.post(url, json=body) as resp:
        resp.raise_for_status()


async def fail_requests(prom: Prometheus, workers: dict[str, str]) -> None:
    """While the third replica joins, under traffic: w1 answers two requests 503."""
    by_name = {name: url for url, name in workers.items()}
    await _post(prom, by_name["w1"] + "/control/fail", {"count": 2, "status": 503})


async def break_streams(prom: Prometheus, workers: dict[str, str]) -> None:
    """Once it is ready: w2 keeps a batch off its live stream and publishes the next, so the
    replicas see the gap at once and replay repairs it; w3 skips a seq, which nothing can."""
    by_name = {name: url for url, name in workers.items()}
    chain = {"token_chains": [[7] * 16]}
    await _post(prom, by_name["w2"] + "/control/drop-next", {"count": 1})
    await _post(prom, by_name["w2"] + "/control/store", chain)
    await _post(prom, by_name["w2"] + "/control/store", chain)
    await _post(prom, by_name["w3"] + "/control/skip-seq", {"count": 1})
    await _post(prom, by_name["w3"] + "/control/store", chain)


async def follow_demo(demo: Any, prom: Prometheus) -> dict[str, str]:
    """Scrape the demo's processes as they appear, until its checks are done; URL -> name."""
    deadline = time.monotonic() + DEMO_WITHIN_S
    known: tuple[dict[str, str], dict[str, str]] = ({}, {})
    failed = broken = False
    while True:
        output = demo.output()
        found = names_in(output)
        if found != known:
            known = found
            prom.set_targets("kvrouter", list(found[0]))
            prom.set_targets("engines", list(found[1]))
        if not failed and "third replica" in output:
            await fail_requests(prom, known[1])
            failed = True
        if not broken and "ca-c ready" in output:
            await break_streams(prom, known[1])
            broken = True
        if _DONE in output:
            break
        if demo.returncode is not None:
            raise RuntimeError(f"the demo exited with {demo.returncode}:\n{demo.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the demo did not finish within {DEMO_WITHIN_S:g} s")
        await asyncio.sleep(0.1)
    routers, workers = known
    names = {urlsplit(u).netloc: n for u, n in routers.items()}
    names |= {urlsplit(u).netloc: n for u, n in workers.items()}
    return names | {u: n for u, n in workers.items()}


async def panel_series(
    prom: Prometheus, panel: dict[str, Any], start: float, end: float, names: dict[str, str]
) -> list[tuple[str, list[float], list[float]]]:
    lines = []
    for target in panel["targets"]:
        for series in await prom.query_range(target["expr"], start, end, 1.0):
            xs = [float(t) - start for t, _ in series["values"]]
            ys = [float(v) for _, v in series["values"]]
            label = legend(target.get("legendFormat", ""), series["metric"], names)
            lines.append((label, xs, ys))
    return lines[:MAX_LINES]


def draw(panels: list[tuple[dict[str, Any], list[Any]]], out: Path) -> Path:
    plt = pyplot()
    if plt is None:
        raise RuntimeError("matplotlib is missing: pip install -e '.[bench]'")
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(4.2 * COLUMNS, 2.6 * rows))
    for ax, (panel, lines) in zip(axes.flat, panels, strict=False):
        ax.set_title(panel["title"], fontsize=8)
        ax.tick_params(labelsize=6)
        for label, xs, ys in lines:
            ax.plot(xs, ys, linewidth=1, label=label)
        if lines:
            ax.legend(fontsize=5, loc="upper left", frameon=False)
        else:
            ax.text(
                0.5,
                0.5,
                "no series in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_ylabel(unit, fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("kvrouter fleet dashboard, from a `kvrouter demo` run (x: seconds)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


async def picture(out: Path) -> Path:
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    with tempfile.TemporaryDirectory(prefix="kvrouter-picture-") as scratch:
        workdir = Path(scratch)
        processes = Processes(workdir / "processes")
        try:
            async with running_prometheus(processes, workdir, ["kvrouter", "engines"]) as prom:
                start = time.time()
                demo = await processes.spawn("demo", kvrouter_argv("demo", *DEMO_ARGS))
                names = await follow_demo(demo, prom)
                await asyncio.sleep(TAIL_S)  # the last scrapes: part of the picture
                end = time.time()
                drawn = [(p, await panel_series(prom, p, start, end, names)) for p in panels]
                demo.send(signal.SIGTERM)  # --keep-running: SIGTERM is its normal end
                await demo.wait_exit(30.0)
        finally:
            await processes.stop_all()
    path = draw(drawn, out)
    empty = [p["title"] for p, lines in drawn if not lines]
    print(f"wrote {path} ({path.stat().st_size:,} bytes); panels without data: {empty or 'none'}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write [{OUT}]")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(picture(args.out))
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main())
