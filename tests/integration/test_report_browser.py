"""Render report.html in headless Chromium with no network: no console errors (CSP
violations and script errors are console errors), every image decoded, the table sorts, and a
screenshot lands in reports/screenshots/ for a person to look at.

Skips, saying why, where Debian's chromium is not installed (.ci/run installs it).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from planner.report import write_report
from planner.report.sample import write_sample_run

CHROMIUM = os.environ.get("PLANNER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = Path(CHROMIUM).exists()
pytestmark = pytest.mark.skipif(not HAVE_CHROMIUM, reason=f"Chromium not found at {CHROMIUM} "
                                "(apt-get install chromium; .ci/run installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio"]
SHOTS = Path(__file__).resolve().parents[2] / "reports" / "screenshots"

# Runs after load: image status, page size, and a sort by the "memory" column both ways.
CHECK_JS = """
window.addEventListener("load", function () {
  var out = {images: [], height: document.documentElement.scrollHeight, sort: null,
             tables: Array.prototype.map.call(document.querySelectorAll("table"), function (tb) { return tb.id; })};
  Array.prototype.forEach.call(document.images, function (i) {
    out.images.push({id: i.id, ok: i.complete && i.naturalWidth > 0, width: i.naturalWidth});
  });
  var t = document.getElementById("top-table");
  if (t) {
    var button = t.tHead.rows[0].cells[5].querySelector("button");
    var col = function () {
      return Array.prototype.map.call(t.tBodies[0].rows, function (r) { return parseFloat(r.cells[5].getAttribute("data-v")); });
    };
    button.click(); var asc = col(); button.click(); var desc = col();
    out.sort = {asc: asc, desc: desc, aria: t.tHead.rows[0].cells[5].getAttribute("aria-sort")};
  }
  // tables wider than their section at this window width (the ladder's measured columns were cut off)
  out.overflow = [];
  document.querySelectorAll("table").forEach(function (tb) {
    var box = tb.closest(".scroll") || tb.parentElement, sec = tb.closest("section");
    if (box.scrollWidth > box.clientWidth + 1 || tb.getBoundingClientRect().right > sec.getBoundingClientRect().right + 1)
      out.overflow.push({table: tb.id, width: box.scrollWidth, room: box.clientWidth});
  });
  var pre = document.createElement("pre");
  pre.id = "report-check";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
"""


def _chromium(args: list[str], profile: Path, timeout: int = 90) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    # own session so that a hang is killed with its helpers, and only them
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout}s: {err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def with_checker(html: str) -> str:
    """The page plus the checker script, its hash added to the page's CSP script-src."""
    digest = base64.b64encode(hashlib.sha256(CHECK_JS.encode()).digest()).decode()
    html, n = re.subn(r"script-src ", f"script-src 'sha256-{digest}' ", html, count=1)
    assert n == 1, "the page has no CSP script-src"
    return html.replace("</body>", f"<script>{CHECK_JS}</script></body>")


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def load_in_chromium(page: Path, work: Path, width: int = 1400) -> tuple[dict, list[str]]:
    probe = work / "probe.html"
    probe.write_text(with_checker(page.read_text()))
    res = _chromium(["--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000", f"--window-size={width},900",
                     "--dump-dom", probe.as_uri()], work / f"profile-dom-{width}")
    m = re.search(r'<pre id="report-check">(.*?)</pre>', res.stdout, re.S)
    assert m, f"the checker did not run; chromium said: {res.stderr[-3000:]}"
    text = m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text), console_lines(res.stderr)


def _measured_ladder(run: Path) -> None:
    """ladder.json of `planner ladder RUN`, with a measured part on each rung so that the table
    has all its columns (test data in the measured fields' shape, planner/ladder/measure.py)."""
    from planner.cli import main
    assert main(["ladder", str(run)]) == 0
    lad = json.loads((run / "ladder.json").read_text())
    for r in lad["rungs"]:
        if "illegal" not in r:
            r["measured"] = {"tokens_per_s": r["tokens_per_s"] * 0.9, "gain": r.get("gain") or 1.0,
                             "peak_memory_gb": r["peak_memory_gb"] * 1.1,
                             "claim": f"{(r.get('gain') or 1.0):.2f}x tokens/s (whole step)"}
    (run / "ladder.json").write_text(json.dumps(lad))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[str], Path]:
    run = tmp_path_factory.mktemp("run") / "glm-130b"
    write_sample_run(run, model="glm-130b", gpus="8x8xA100-80GB", global_batch=512, seq_len=2048,
                     study_trials=60, metrics=True, verify=True)
    _measured_ladder(run)
    page = write_report(run, price_per_gpu_hour=2.5)
    work = Path(tempfile.mkdtemp(prefix="report-browser-"))
    try:
        check, console = load_in_chromium(page, work)
        yield page, check, console, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_no_console_errors(rendered) -> None:
    _, _, console, _ = rendered
    assert console == [], "console messages:\n" + "\n".join(console)


def test_every_image_loaded(rendered) -> None:
    _, check, _, _ = rendered
    ids = {i["id"] for i in check["images"]}
    assert {"img-frontier", "img-memory", "img-time", "img-gantt", "img-history", "img-importances",
            "img-cluster", "img-measured", "img-loss"} <= ids
    bad = [i for i in check["images"] if not i["ok"]]
    assert not bad, f"images that did not load: {bad}"


def test_every_table_fits_at_1400_px(rendered) -> None:
    """At a 1400 px window no table is wider than its section (the ladder's measured columns and
    the top plans' last column were cut off)."""
    _, check, _, _ = rendered
    assert "ladder-table" in check["tables"] and "top-table" in check["tables"]
    assert check["overflow"] == [], check["overflow"]


def test_table_sorts_both_ways(rendered) -> None:
    _, check, _, _ = rendered
    s = check["sort"]
    assert s and len(s["asc"]) >= 2
    assert s["asc"] == sorted(s["asc"]) and s["desc"] == sorted(s["desc"], reverse=True)
    assert s["asc"] != s["desc"] and s["aria"] == "descending"


def test_blocked_script_would_be_reported(tmp_path: Path) -> None:
    """The harness can fail: an inline script the CSP does not allow shows up on the console."""
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><html><head><meta http-equiv=\"Content-Security-Policy\" "
                    "content=\"default-src 'none'; script-src 'none'\"></head><body>"
                    "<img src=\"https://example.invalid/x.png\"><script>alert(1)</script></body></html>")
    res = _chromium(["--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
                    tmp_path / "profile")
    assert console_lines(res.stderr), res.stderr[-2000:]


def test_injected_markup_stays_inert(tmp_path: Path) -> None:
    """A model name and command carrying HTML/script: no script runs, no extra image appears."""
    import dataclasses

    from planner.specs import preset
    evil = '<script>console.error("pwned")</script><img src=x onerror="console.error(1)">'
    run = write_sample_run(tmp_path / "run", model=dataclasses.replace(preset("glm-10b"), name=evil),
                           study_trials=0, command=f"planner search --model '{evil}'")
    check, console = load_in_chromium(write_report(run), tmp_path)
    assert console == [], "console messages:\n" + "\n".join(console)
    assert all(i["ok"] and i["id"].startswith("img-") for i in check["images"]), check["images"]


def test_screenshot(rendered) -> None:
    page, check, _, work = rendered
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / "report.png"
    height = max(800, min(int(check["height"]) + 20, 16000))
    _chromium([f"--window-size=1400,{height}", f"--screenshot={shot}", page.as_uri()], work / "profile-shot")
    assert shot.exists() and shot.stat().st_size > 50_000, "no screenshot written"
