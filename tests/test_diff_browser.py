"""The diff report of the bundled example as a person sees it at 1600×1200: it opens on the
kernel (its box in the first screen, inside its pane), one scale per pair, labels of at
least 9 px, pictures of sane size, and per-site numbers that are the text diff's and agree
with the boxes drawn. Sizes are checked from the page's SVG here, and measured in headless
Chromium where it is installed (Debian: apt-get install chromium). No graphviz needed."""

from __future__ import annotations

import html
import json
import pathlib
import re
import shutil
import struct
import subprocess

import pytest
from click.testing import CliRunner

from hlotool.cli import cli

# Two full diffs of the example and a browser: CI's slow pass.
pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")
EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "causal_decoder.py"
# Box labels are 11 px at scale 1; the report never scales them below 9 px.
LABEL_PX = 11
SCREEN = (1600, 1200)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The README's command on the bundled example, and its text diff."""
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "report.html"
    result = CliRunner().invoke(cli, ["diff", str(EXAMPLE), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = CliRunner().invoke(cli, ["diff", str(EXAMPLE)], env={"COLUMNS": "1000"})
    assert text.exit_code == 0, text.output
    return out, text.stdout


def _size(svg: str) -> tuple[float, float, float]:
    """(drawn width px, drawn height px, viewBox width) of an inline SVG."""
    m = re.search(r'<svg xmlns="[^"]+" width="([\d.]+)" height="([\d.]+)" '
                  r'viewBox="0 0 ([\d.]+) ', svg)
    return float(m.group(1)), float(m.group(2)), float(m.group(3))


def _pairs(text: str) -> list[list[str]]:
    return [re.findall(r"<svg\b.*?</svg>", pair, re.S)
            for pair in re.findall(r'<div class="pair">(.*?)</div></div></div>', text, re.S)]


def test_pairs_share_one_scale_and_stay_a_sane_size(page):
    text = page[0].read_text()
    pairs = _pairs(text)
    assert len(pairs) >= 4  # train_step's two layers and "other", forward's two sites
    for native, rewritten in pairs:
        (nw, nh, nv), (rw, rh, rv) = _size(native), _size(rewritten)
        assert abs(nw / nv - rw / rv) < 0.01  # native and rewritten at one scale
        assert min(nw / nv, rw / rv) * LABEL_PX >= 9.0  # px of a label at the page's zoom
        # Was: a 6000 px wide rewritten side and a 4000 px tall native one.
        assert max(nw, rw) <= 1.2 * 760 and max(nh, rh) <= 2.5 * SCREEN[1], (nw, nh, rw, rh)
    assert "max-width:100%" not in text  # browser zoom works on the drawings


def test_kernel_is_one_box_with_its_inside_on_demand(page):
    text = page[0].read_text()
    for rewritten in re.findall(r"<h3>rewritten.*?</svg>", text, re.S):
        assert rewritten.count('class="node kernel"') <= 1
    first = re.findall(r"<h3>rewritten.*?</svg>", text, re.S)[0]
    assert first.count('class="node kernel"') == 1 and "chunked kernel" in first
    assert first.count('class="node ') < 40  # the box replaces the kernel's instructions
    inside = re.search(r"<details><summary>inside the chunked kernel \((\d+) instructions, "
                       r"drawn as one box above\)</summary>(.*?)</details>", text, re.S)
    assert inside and int(inside.group(1)) > 100 and "<svg" in inside.group(2)
    assert "<details open><summary>forward: normalized HLO diff" in text
    assert "<script" not in text and " src=" not in text and "<link" not in text


def test_numbers_per_site_are_the_text_diffs(page):
    text, summary = page[0].read_text(), page[1]
    shown = [html.unescape(line) for line in re.findall(r'<p class="line">(.*?)</p>', text)]
    said = [line.split(": ", 2)[2] for line in summary.splitlines()
            if re.match(r"  (site \d+|other): ", line)]
    assert shown == said
    # Both layers of train_step are rewritten, each counted once (how many L×L buffers
    # XLA:CPU keeps varies with jaxlib: 28 native on 0.10, 27 on 0.12.1).
    assert all(re.match(r"−\d+ instructions, \+\d+, L×L buffers \d+ → \d+ ", line)
               for line in said[:2]), said
    assert "no change" not in said
    # Every coloured box of a site's picture is its own: the changes outside any site add
    # nothing, and their picture shows no added box.
    other = re.search(r'<section id="f0-s2"><h2>train_step · other:.*?</section>', text, re.S)
    assert ", +0" in other.group(0) and 'class="node added"' not in other.group(0)


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         f"--window-size={SCREEN[0]},{SCREEN[1]}", *args],
        capture_output=True, text=True, timeout=120, check=False)


# Injected into a copy of the page (the report itself runs no script): where the first
# kernel box is on the screen and in its pane, the smallest label of the side-by-side
# drawings in screen px, and the scale of each drawing.
MEASURE = """<script>
addEventListener("load", () => {
  const rect = e => { const r = e.getBoundingClientRect();
                      return [r.left, r.top, r.right, r.bottom]; };
  const box = document.querySelector(".pair .node.kernel");
  const px = [...document.querySelectorAll(".pane svg text")]
    .filter(t => t.getBBox().width > 0 && t.closest("details") === null)
    .map(t => parseFloat(getComputedStyle(t).fontSize) * t.getScreenCTM().a);
  const scales = [...document.querySelectorAll(".pair svg")].map(s => s.getScreenCTM().a);
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({
    min_px: Math.min(...px), labels: px.length, scales, kernel: rect(box),
    pane: rect(box.closest(".pane")), screen: [innerWidth, innerHeight]});
  document.body.append(out);
});
</script>"""


@needs_chromium
def test_in_chromium_at_1600x1200_the_kernel_is_in_the_first_screen(page, tmp_path):
    report = page[0]
    shot = tmp_path / "report.png"
    done = _chromium(tmp_path, f"--screenshot={shot}", report.as_uri())
    assert shot.is_file(), done.stderr
    assert _png_size(shot) == SCREEN
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", MEASURE + "</body>"))
    dom = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout)
    assert found, dom.stderr[-2000:]
    m = json.loads(found.group(1))
    width, height = m["screen"]  # the viewport: headless Chromium's window less its frame
    assert width == SCREEN[0] and height <= SCREEN[1]
    left, top, right, bottom = m["kernel"]
    assert 0 <= left and right <= width and 0 <= top and bottom <= height, m
    p_left, p_top, p_right, p_bottom = m["pane"]
    assert p_left <= left and right <= p_right and p_top <= top and bottom <= p_bottom, m
    assert m["labels"] > 20
    assert m["min_px"] >= 9.0, m
    first, second = m["scales"][:2]
    assert abs(first - second) < 0.01, m  # one scale for both sides
