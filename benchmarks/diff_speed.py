"""`hlotool diff` on a 24-layer decoder: hlotool's own time beside jax's.

    JAX_PLATFORMS=cpu python benchmarks/diff_speed.py [--layers 24] [--stage hlo]
        [--target cpu] [--seq-len 512]

Runs examples/causal_decoder.py (--layers, --seq-len, no training step) under capture,
then does what `hlotool diff SCRIPT:forward -o report.html` does, timing each step:
  jax       running the script, lowering (and, for --stage optimized, compiling) the native
            and the rewritten program
  hlotool   detecting sites, flash_jit's trace-time rewrite, parsing + structural diff,
            the text summary, the HTML report (graphviz `dot` included)
and prints the table; the target is hlotool's total under 10 s. Also checks the answer:
one changed site per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.extend.core import jaxpr_as_fun  # noqa: E402

from hlotool.report import render  # noqa: E402
from hlotool.capture import capture_script, select  # noqa: E402
from hlotool.api import flash_jit  # noqa: E402
from hlotool.passes.diff import FunctionDiff, by_site, diff_modules, site_nodes  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "causal_decoder.py")


class Clock:
    def __init__(self):
        self.rows: list[tuple[str, str, float]] = []

    def __call__(self, owner: str, name: str, fn):
        start = time.perf_counter()
        out = fn()
        self.rows.append((owner, name, time.perf_counter() - start))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stage", choices=("hlo", "optimized"), default="hlo")
    parser.add_argument("--target", default="cpu")
    args = parser.parse_args()

    clock = Clock()
    script_args = ["--layers", str(args.layers), "--seq-len", str(args.seq_len), "--steps", "0"]
    [f] = clock("jax", "run script (capture)",
                lambda: select(capture_script(EXAMPLE, script_args), "forward"))
    native_pre = clock("jax", "lower native", lambda: f.hlo(target=args.target))
    sites = clock("hlotool", "detect sites", lambda: site_nodes(native_pre, f.name))
    fun = jaxpr_as_fun(f.closed_jaxpr)
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in f.in_avals]
    closed = clock("hlotool", "flash_jit rewrite (trace)",
                   lambda: jax.make_jaxpr(flash_jit(fun))(*sds))
    rewritten = dataclasses.replace(f, closed_jaxpr=closed, _lowered={}, _compiled={})
    after_pre = clock("jax", "lower rewritten", lambda: rewritten.hlo(target=args.target))
    if args.stage == "hlo":
        before, after = native_pre, after_pre
    else:
        before = clock("jax", "compile native", lambda: f.optimized(args.target))
        after = clock("jax", "compile rewritten", lambda: rewritten.optimized(args.target))
        sites = [(s, set(), lines) for s, _, lines in sites]
    d = clock("hlotool", "parse + structural diff", lambda: diff_modules(before, after))
    fd = FunctionDiff(f.name, args.stage, args.target, d, by_site(d, sites))
    clock("hlotool", "text summary + unified diff",
          lambda: (render.text_summary([fd]), d.unified()))
    page = clock("hlotool", "HTML report (with dot)", lambda: render.html_report([fd]))

    changed = [c for c in fd.changes if c.site is not None and c.regions]
    if len(changed) != args.layers:
        raise SystemExit(f"expected {args.layers} changed sites, got {len(changed)}")
    with tempfile.NamedTemporaryFile("w", suffix=".html", delete=False) as out:
        out.write(page)

    size = sum(len(c) for c in d.before.computations.values())
    print(f"{args.layers}-layer decoder, L={args.seq_len}, stage {args.stage}, target "
          f"{args.target}: {size} native instructions, {len(d.removed)} removed, "
          f"{len(d.added)} added, {len(changed)} changed sites; report {len(page) // 1024} KiB "
          f"({out.name})\n")
    print(f"{'step':<32}{'owner':<10}{'seconds':>9}")
    print("-" * 51)
    for owner, name, t in clock.rows:
        print(f"{name:<32}{owner:<10}{t:>9.2f}")
    print("-" * 51)
    for owner in ("jax", "hlotool"):
        total = sum(t for o, _, t in clock.rows if o == owner)
        print(f"{'total ' + owner:<42}{total:>9.2f}")


if __name__ == "__main__":
    main()
