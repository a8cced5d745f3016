"""The HTML compile report and the plan pictures: sections, rows, images, colours, writing, and
the page as headless Chromium renders it (skipped where Chromium is not installed)."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import io
import re
import sys

import numpy as np
import pytest
import repo_paths
from matplotlib.image import imread

from autopar.errors import InvalidOptionError
from autopar.plan import Plan, StagePlan
from autopar.report.html import render_html, save_html, section_ids
from autopar.report.pictures import (
    UNUSED_COLOUR,
    mesh_figure,
    mesh_layout,
    mesh_png_bytes,
    save_mesh_png,
    stage_colours,
    swimlane_png_bytes,
)
from autopar.report.text import plan_timeline

_SCRIPT = repo_paths.REPO / "scripts" / "check_html_report.py"


def _load_check_script():
    spec = importlib.util.spec_from_file_location("check_html_report", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


check = _load_check_script()


@pytest.fixture(scope="module")
def shard_report():
    return check.build_report("shard")


@pytest.fixture(scope="module")
def pipe_report():
    return check.build_report("pipeshard")


@pytest.fixture(params=["shard", "pipeshard"])
def report(request, shard_report, pipe_report):
    return shard_report if request.param == "shard" else pipe_report


def _synthetic_plan(stages: list[tuple[tuple[int, int], tuple[int, ...]]]) -> Plan:
    """A plan with just the fields the mesh picture reads: (submesh, device ids) per stage."""
    return Plan(
        method="pipeshard",
        mesh_shape=(len(stages),),
        cluster="test",
        stages=[
            StagePlan(
                index=i,
                layers=(i,),
                submesh_shape=submesh,
                logical_mesh_shape=(len(devices),),
                axis_names=("x",),
                device_ids=devices,
            )
            for i, (submesh, devices) in enumerate(stages)
        ],
        est_step_time_s=1.0,
        total_flops=1.0,
    )


def _pixels(png: bytes) -> np.ndarray:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return np.round(imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(int)


def _colour_count(pixels: np.ndarray, colour) -> int:
    from matplotlib.colors import to_rgb

    want = np.round(np.array(to_rgb(colour)) * 255).astype(int)
    return int(np.all(np.abs(pixels - want) <= 1, axis=-1).sum())


def test_sections_are_the_plans(shard_report, pipe_report):
    assert section_ids(shard_report) == [
        "summary", "stages", "mesh", "collectives", "shardings", "solver", "notes",
    ]  # fmt: skip
    # the stage search compared its own stages with the hand splits: they are listed
    assert section_ids(pipe_report) == [
        "summary", "candidates", "stages", "mesh", "pipeline", "collectives", "shardings",
        "notes",
    ]  # fmt: skip


def test_page_has_every_section_row_and_image(report):
    plan = report.plan
    page = render_html(report)
    summary = check.summarize(page)
    for sid in section_ids(report):
        assert summary.ids.count(sid) == 1, sid
        assert f'<section id="{sid}">' in page
    assert summary.rows["stage"] == len(plan.stages)
    shardings = plan.shardings()
    assert summary.rows["sharding"] == len(shardings)
    for path, spec in shardings.items():  # every leaf, none cut off as in the text report
        assert f'<td class="code">{html.escape(path)}</td>' in page
        assert html.escape(spec) in page
    assert len(summary.images) == (2 if plan_timeline(plan) is not None else 1)
    for img in summary.images:
        assert imread(io.BytesIO(check.decode_png(img["src"])), format="png").size > 0
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "<script" not in page and "<link" not in page


def test_collectives_say_not_compiled_without_hlo(shard_report):
    page = render_html(shard_report)
    assert shard_report.hlo_collectives is None
    collectives = page.split('<section id="collectives">')[1].split("</section>")[0]
    assert "not compiled" in collectives
    kind = next(iter(shard_report.predicted_collectives()))
    counted = dataclasses.replace(shard_report, hlo_collectives={kind: {"count": 1, "bytes": 1024}})
    counted_page = render_html(counted).split('<section id="collectives">')[1]
    assert "not compiled" not in counted_page.split("</section>")[0]
    assert "1.00 KiB" in counted_page


def test_text_is_escaped(pipe_report):
    noted = dataclasses.replace(pipe_report, model="<b>gpt</b>", notes=["a < b & c"])
    page = render_html(noted)
    assert "&lt;b&gt;gpt&lt;/b&gt;" in page and "<b>gpt" not in page
    assert "a &lt; b &amp; c" in page


def test_mesh_layout_places_devices_by_host():
    plan = _synthetic_plan([((1, 4), (0, 1, 2, 3)), ((2, 4), tuple(range(8, 16)))])
    layout = mesh_layout(plan)
    assert (layout.per_host, layout.rows) == (4, 4)
    assert layout.cell(9) == (2, 1)
    assert layout.stage_of_device == {d: 0 for d in range(4)} | {d: 1 for d in range(8, 16)}


def test_mesh_picture_has_one_colour_per_stage():
    plan = _synthetic_plan(
        [((1, 2), (0, 1)), ((1, 2), (2, 3)), ((1, 4), (4, 5, 6, 7)), ((1, 2), (10, 11))]
    )
    pixels = _pixels(mesh_png_bytes(plan))
    colours = stage_colours(5)
    counts = [_colour_count(pixels, c) for c in colours]
    # Stages' cells fill hundreds of pixels each (the legend swatch alone would be ~100); the
    # fifth palette colour belongs to no stage and must not appear.
    assert all(n > 1000 for n in counts[:4]), counts
    assert counts[4] == 0
    assert counts[2] > 1.5 * counts[0]  # stage 2 has twice the devices of stage 0
    assert _colour_count(pixels, UNUSED_COLOUR) > 1000  # devices 8 and 9: no stage
    # One text label per cell: device id and stage.
    texts = [t.get_text() for t in mesh_figure(plan).axes[0].texts]
    assert "d5\nS2 (1)" in texts and "d8\nunused" in texts and len(texts) == 12


def test_single_stage_plan_is_drawn(shard_report):
    pixels = _pixels(mesh_png_bytes(shard_report.plan))
    assert _colour_count(pixels, stage_colours(1)[0]) > 1000


def test_stage_colours_are_distinct():
    for n in (1, 2, 10, 11, 20, 21, 64):
        colours = [tuple(round(255 * c) for c in rgb) for rgb in stage_colours(n)]
        assert len(set(colours)) == n


def test_swimlane_bytes_match_the_file(pipe_report, tmp_path):
    from autopar.report.swimlane import save_swimlane_png

    timeline = plan_timeline(pipe_report.plan)
    png = swimlane_png_bytes(timeline, "t")
    save_swimlane_png(timeline, tmp_path / "s.png", "t")
    assert _pixels(png).shape == _pixels((tmp_path / "s.png").read_bytes()).shape


def test_save_html_and_mesh_png_write_whole_files(pipe_report, tmp_path):
    save_html(pipe_report, tmp_path / "report.html")
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == render_html(pipe_report)
    save_mesh_png(pipe_report.plan, tmp_path / "mesh.png")
    assert _pixels((tmp_path / "mesh.png").read_bytes()).size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mesh.png", "report.html"]


def test_save_html_to_an_unwritable_path_is_one_line(pipe_report, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "report.html"  # a file's "child": unwritable even for root
    with pytest.raises(InvalidOptionError) as info:
        save_html(pipe_report, target)
    message = str(info.value)
    assert "\n" not in message and str(target) in message
    with pytest.raises(InvalidOptionError, match="mesh picture"):
        save_mesh_png(pipe_report.plan, target)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


# the end-to-end tier: a real browser (headless Chromium) builds the page, about 12 s a case
@pytest.mark.e2e
def test_headless_chromium_renders_the_report(report, tmp_path):
    chromium = check.find_chromium()
    if chromium is None:
        pytest.skip("chromium not found on PATH (the browser check needs headless Chromium)")
    lines = check.check_in_browser(report, chromium, tmp_path)
    assert any("chromium DOM: sections" in line for line in lines)
    assert any("decoded at" in line for line in lines)
    assert any("screenshot" in line for line in lines)


def test_report_of_a_saved_plan_has_dashes(shard_report):
    # CompileReport.from_plan (autopar show) knows no graph, parameters or compile time.
    saved = dataclasses.replace(
        shard_report, graph_nodes=None, graph_edges=None, num_params=None, compile_time_s=None
    )
    page = render_html(saved)
    summary = page.split('<section id="summary">')[1].split("</section>")[0]
    for key in ("graph", "parameters", "compile time"):
        assert f"<tr><th>{key}</th><td>-</td></tr>" in summary
    assert "a report of a saved plan" in page
