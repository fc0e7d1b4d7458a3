"""The diff report as a person sees it at 1600×1200: one scale per pair, labels of at least
9 px, the kernel as one box with its inside on demand, no script of its own. The sizes are
checked from the page's SVG here, and measured in headless Chromium where it is installed
(Debian: apt-get install chromium)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess

import pytest
from click.testing import CliRunner

from hlotool.cli import cli

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="graphviz `dot` not installed (apt-get install graphviz)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")

# At L = 512 the cost verdict picks the chunked kernel on the CPU: a 100-instruction kernel.
MODEL = """\
import jax, jax.numpy as jnp

@jax.jit
def forward(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

x = jnp.ones((1, 512, 2, 16))
forward(x, x, x)
"""
# dot's labels are 10 pt; 1 pt is 4/3 px.
LABEL_PT = 10


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "model.py").write_text(MODEL)
    out = tmp / "report.html"
    result = CliRunner().invoke(cli, ["diff", str(tmp / "model.py"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _sizes(svg: str) -> tuple[float, float]:
    """(drawn width in pt, viewBox width) of an inline SVG."""
    width = float(re.search(r'<svg width="([\d.]+)pt"', svg).group(1))
    view = float(re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) ', svg).group(1))
    return width, view


@needs_dot
def test_pairs_share_one_scale_and_labels_stay_readable(page):
    text = page.read_text()
    pair = re.search(r'<div class="pair">(.*?)</div></div></div>', text, re.S).group(1)
    sides = re.findall(r"<svg\b.*?</svg>", pair, re.S)
    assert len(sides) == 2
    scales = [w / v for w, v in map(_sizes, sides)]
    assert abs(scales[0] - scales[1]) < 0.01  # native and rewritten at one scale
    assert min(scales) * LABEL_PT * 4 / 3 >= 9.0  # px of a label at the page's own zoom
    assert "max-width:100%" not in text  # browser zoom works on the drawings


@needs_dot
def test_kernel_is_one_box_with_its_inside_on_demand(page):
    text = page.read_text()
    rewritten = re.findall(r"<h3>rewritten.*?</svg>", text, re.S)[0]
    assert rewritten.count('class="node kernel"') == 1
    assert "chunked kernel" in rewritten
    # The box replaces the kernel's instructions: the side stays small.
    assert rewritten.count('class="node ') < 40
    inside = re.search(r"<details><summary>inside the chunked kernel \((\d+) instructions, "
                       r"drawn as one box above\)</summary>(.*?)</details>", text, re.S)
    assert inside and int(inside.group(1)) > 40 and "<svg" in inside.group(2)
    assert "<details open><summary>forward: normalized HLO diff" in text
    assert "<script" not in text and " src=" not in text and "<link" not in text


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         "--window-size=1600,1200", *args],
        capture_output=True, text=True, timeout=120, check=False)


# Injected into a copy of the page (the report itself runs no script): the smallest label
# of the side-by-side drawings, in screen px, and the scale of each drawing.
MEASURE = """<script>
addEventListener("load", () => {
  const px = [...document.querySelectorAll(".pane svg text")]
    .filter(t => t.getBBox().width > 0 && t.closest("details") === null)
    .map(t => parseFloat(getComputedStyle(t).fontSize) * t.getScreenCTM().a);
  const scales = [...document.querySelectorAll(".pair svg")].map(s => s.getScreenCTM().a);
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({min_px: Math.min(...px), labels: px.length, scales});
  document.body.append(out);
});
</script>"""


@needs_dot
@needs_chromium
def test_in_chromium_at_1600x1200(page, tmp_path):
    shot = tmp_path / "report.png"
    done = _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.is_file(), done.stderr
    assert _png_size(shot) == (1600, 1200)
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    dom = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout)
    assert found, dom.stderr[-2000:]
    measured = json.loads(found.group(1))
    assert measured["labels"] > 20
    assert measured["min_px"] >= 9.0, measured
    first, second = measured["scales"][:2]
    assert abs(first - second) < 0.01, measured  # one scale for both sides
