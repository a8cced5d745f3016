#!/usr/bin/env python
"""Check the HTML compile report in a real browser (headless Chromium).

Builds the report of a zoo model's plan (GPT tiny on 8 simulated CPU devices: a ShardParallel
plan and a pipelined PipeshardParallel plan), writes each as HTML to a temporary directory and:

1. checks the page itself: every section id, one stage row per stage, one shardings row per
   input leaf, every ``<img>`` a PNG data URI that decodes, no ``http(s)://`` reference;
2. loads it in headless Chromium with ``--dump-dom`` and checks the DOM Chromium built has the
   same sections and rows; a copy of the page with a tiny inline script (the report itself has
   none) records each image's decoded size, so the DOM also shows Chromium decoded every image;
3. takes a ``--screenshot`` (1280x2000) and checks it is not blank and shows the stage colours
   of the mesh picture.

Usage::

    python scripts/check_html_report.py [--chromium PATH] [--method shard|pipeshard|both]
                                        [--keep DIR]

Prints one line per check; exits 0 when all pass, 1 with a message on the first failure.
``tests/test_html_report.py`` imports these functions for its browser test.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

# Before JAX is imported (by autopar): 8 simulated CPU devices, as the test suite uses.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from autopar.report.html import render_html, section_ids  # noqa: E402
from autopar.report.pictures import stage_colours  # noqa: E402
from autopar.report.text import CompileReport  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Records each image's decoded size in the DOM that --dump-dom prints (check page only).
_DECODE_PROBE = (
    "<script>window.addEventListener('load', () => { for (const img of document.images) "
    "img.setAttribute('data-decoded', img.naturalWidth + 'x' + img.naturalHeight); });</script>"
)
_TIMEOUT_S = 120


class CheckFailed(Exception):
    """A check did not pass; the message says which and why."""


@dataclass
class PageSummary:
    """What a page holds, as the checks need it."""

    ids: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # tr class -> count
    images: list[dict[str, str]] = field(default_factory=list)  # each <img>'s attributes
    urls: list[str] = field(default_factory=list)  # src/href values naming http(s)


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = PageSummary()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = {k: v or "" for k, v in attrs}
        if "id" in named:
            self.page.ids.append(named["id"])
        if tag == "tr" and named.get("class"):
            self.page.rows[named["class"]] = self.page.rows.get(named["class"], 0) + 1
        if tag == "img":
            self.page.images.append(named)
        for key in ("src", "href"):
            if re.match(r"\s*https?://", named.get(key, ""), re.IGNORECASE):
                self.page.urls.append(named[key])


def summarize(page: str) -> PageSummary:
    """Parse an HTML page (the report or a browser's DOM dump) into a :class:`PageSummary`."""
    collector = _Collector()
    collector.feed(page)
    collector.close()
    return collector.page


def decode_png(data_uri: str) -> bytes:
    """The PNG bytes of a ``data:image/png;base64,...`` URI; ``CheckFailed`` if it is not one."""
    prefix = "data:image/png;base64,"
    if not data_uri.startswith(prefix):
        raise CheckFailed(f"image source is not a PNG data URI: {data_uri[:40]!r}")
    png = base64.b64decode(data_uri[len(prefix) :], validate=True)
    if not png.startswith(PNG_SIGNATURE):
        raise CheckFailed("image data URI does not hold a PNG")
    return png


def read_png(png: bytes):
    """Decode PNG bytes to an RGB(A) float array with matplotlib (raises on a bad PNG)."""
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def check_page(report: CompileReport, page: str, where: str) -> list[str]:
    """Check sections, rows and images of ``page``; returns one line per passed check."""
    plan = report.plan
    summary = summarize(page)
    passed = []
    missing = [sid for sid in section_ids(report) if sid not in summary.ids]
    if missing:
        raise CheckFailed(f"{where}: sections missing: {', '.join(missing)}")
    passed.append(f"{where}: sections {', '.join(section_ids(report))}")
    for kind, want in (("stage", len(plan.stages)), ("sharding", len(plan.shardings()))):
        got = summary.rows.get(kind, 0)
        if got != want:
            raise CheckFailed(f"{where}: {got} {kind} rows, expected {want}")
        passed.append(f"{where}: {got} {kind} rows")
    want_images = 2 if "pipeline" in section_ids(report) else 1
    if len(summary.images) != want_images:
        raise CheckFailed(f"{where}: {len(summary.images)} images, expected {want_images}")
    for img in summary.images:
        array = read_png(decode_png(img.get("src", "")))
        passed.append(
            f"{where}: image '{img.get('alt')}' decodes ({array.shape[1]}x{array.shape[0]} PNG)"
        )
    if summary.urls:
        raise CheckFailed(f"{where}: external references: {summary.urls[:3]}")
    passed.append(f"{where}: no http(s) src/href")
    return passed


def find_chromium(explicit: str | None = None) -> str | None:
    """``explicit`` if given, else ``chromium`` (or ``chromium-browser``) on PATH."""
    if explicit:
        return explicit
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(chromium: str, workdir: Path, *args: str) -> str:
    """Run headless Chromium with a fresh profile and networking off; returns its stdout."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir)
    command = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", *args,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"chromium did not run: {exc}") from exc
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no stderr"])[-1]
        raise CheckFailed(f"chromium exited with {done.returncode}: {tail}")
    return done.stdout


def check_in_browser(report: CompileReport, chromium: str, workdir: Path) -> list[str]:
    """All checks for one report (page, DOM, decoded images, screenshot); see the docstring."""
    name = f"{report.plan.method}"
    page = render_html(report)
    html_path = workdir / f"report-{name}.html"
    html_path.write_text(page, encoding="utf-8")
    passed = check_page(report, page, f"{name} html")

    probe_path = workdir / f"report-{name}-probe.html"
    probe_path.write_text(page.replace("</body>", _DECODE_PROBE + "</body>"), encoding="utf-8")
    dom = run_chromium(
        chromium, workdir, "--virtual-time-budget=5000", "--dump-dom", probe_path.as_uri()
    )
    passed += check_page(report, dom, f"{name} chromium DOM")
    for img in summarize(dom).images:
        size = img.get("data-decoded", "")
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", size):
            raise CheckFailed(
                f"{name}: chromium did not decode image '{img.get('alt')}' "
                f"(decoded size {size or 'missing'})"
            )
        passed.append(f"{name} chromium DOM: image '{img.get('alt')}' decoded at {size}")

    shot = workdir / f"report-{name}.png"
    run_chromium(
        chromium, workdir, f"--screenshot={shot}", "--window-size=1280,2000", html_path.as_uri()
    )
    if not shot.is_file():
        raise CheckFailed(f"{name}: chromium wrote no screenshot")
    passed.append(check_screenshot(report, shot.read_bytes(), name))
    return passed


def check_screenshot(report: CompileReport, png: bytes, name: str) -> str:
    """The screenshot is not blank and shows every stage's colour (the mesh picture)."""
    import numpy as np

    pixels = np.round(read_png(png)[..., :3] * 255).astype(int)
    # each pixel's colour as one integer: np.unique over rows (axis=0) of a 1280 x 2000
    # screenshot took about 4 s, over packed integers a tenth of a second
    colours = np.unique(pixels[..., 0] * 65536 + pixels[..., 1] * 256 + pixels[..., 2])
    if len(colours) < 16:
        raise CheckFailed(f"{name}: screenshot looks blank ({len(colours)} colours)")
    for stage, colour in enumerate(stage_colours(len(report.plan.stages))):
        want = np.round(np.array(colour) * 255).astype(int)
        # A few levels of tolerance: the browser may scale the picture.
        close = np.all(np.abs(pixels - want) <= 3, axis=-1).sum()
        if close < 200:
            raise CheckFailed(
                f"{name}: screenshot shows stage {stage}'s colour on only {close} pixels"
            )
    return f"{name} screenshot: {len(colours)} colours, every stage colour visible"


def build_report(method: str) -> CompileReport:
    """The compile report of GPT tiny under ``method`` (``shard`` or ``pipeshard``)."""
    import autopar
    from autopar.compiler.graph.trace import trace_step
    from autopar.models import get_model
    from autopar.runtime.local_cluster import local_cluster

    model = get_model("gpt", "tiny")
    traced = trace_step(model.train_step, model.abstract_inputs())
    if method == "shard":
        from autopar.compiler.planners.dispatch import plan_traced

        method_ = autopar.ShardParallel(mesh_shape=(2, 4))
        plan = plan_traced(traced, method_, local_cluster(), batch_argnums=(1,))
    else:
        from autopar.compiler.planners.pipeshard import plan_pipeshard
        from autopar.ir.pipeline_program import build_pipeline_program

        marked = model.with_value_and_grad(autopar.value_and_grad)
        pp = build_pipeline_program(marked.train_step, marked.abstract_inputs(), (1,), 4)
        method_ = autopar.PipeshardParallel(num_microbatches=4, num_stages=2)
        plan = plan_pipeshard(pp, method_, local_cluster())
    return CompileReport.build(
        model="gpt tiny",
        plan=plan,
        graph=traced.graph,
        num_params=model.num_params(),
        compile_time_s=0.0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default=None, help="Chromium binary (default: on PATH)")
    parser.add_argument("--method", choices=("shard", "pipeshard", "both"), default="both")
    parser.add_argument("--keep", default=None, help="write the pages and screenshots here")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None or not Path(chromium).exists():
        print(f"FAIL: chromium not found ({chromium or 'not on PATH'}); pass --chromium PATH")
        return 1
    methods = ("shard", "pipeshard") if args.method == "both" else (args.method,)
    with tempfile.TemporaryDirectory(prefix="autopar-html-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for method in methods:
                for line in check_in_browser(build_report(method), chromium, workdir):
                    print(f"ok   {line}")
        except CheckFailed as exc:
            print(f"FAIL {exc}")
            return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
