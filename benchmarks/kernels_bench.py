"""Chunked (blockwise online-softmax) attention vs the naive jitted formula on this CPU.

Each measurement runs in its own process, so peak RSS (`ru_maxrss`) belongs to one kernel at
one length. Every child is capped with RLIMIT_AS; a naive run whose score matrices alone
would pass the cap is not started and shows as "OOM (needs ≈X GB)".

    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --lengths 1024,2048 --cap-gb 8
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --mask window:512 --lengths 8192
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --rates --mask causal --lengths 4096,8192
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --breakdown --mask causal --lengths 4096
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --floors --mask causal --lengths 4096,8192

`--rates` prints, instead, the chunked kernel's forward and backward rate against this machine's
own matmul rate on attention blocks ([8,512,64]×[8,64,512], then [8,512,512]×[8,512,64], in a
loop), measured in the same process, each kernel call right after a matmul call, so slow
phases of a shared machine hit both; the ratios are medians over --repeats such pairs. Only the
visible (unmasked) work counts: 2 matmuls per visible query-key pair forward, 5 backward (the
score recompute, dP, dV, dK, dQ; the FlashAttention papers' 2.5×), each 2·D flops.

`--floors` prints, for the forward, how far it is from what blockwise work costs on this
machine: loops over the very tiles the kernel computes that do less than it does — the tiles'
two matmuls alone; plus a softmax of each tile on its own; plus the online softmax's running
max, normalizer and output carried across tiles — and the kernel's forward, each as a ratio to
the block-matmul rate, paired as --rates pairs them.

`--breakdown` prints where the chunked kernel's forward and backward spend their time: XLA:CPU's
own per-op trace (`jax.profiler`, a Perfetto trace), each op's time summed over --repeats calls
and put in one class by what its fused computation does (a dot: matmul; else an exponential:
exp; else a reduce: reduce; else only copies, slices, transposes, broadcasts: data movement;
else elementwise), as a share of the ops' total.

Shapes: B=1, H=8, D=64, float32, q/k/v [B, L, H, D]; `--mask` none (default), causal, or
window:W (causal, each query sees its W most recent keys, as Mistral): the naive side applies
it with `jnp.where` over iotas, the chunked kernel skips the blocks outside it. Times exclude compilation
(best of --repeats runs after one warm-up call): wall seconds, and in parentheses the
process's CPU seconds (all threads), which other load on a shared machine inflates less.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import resource
import subprocess
import sys
import time

B, H, D = 1, 8, 64
# Live [B, H, L, L] float32 matrices the naive program holds at its peak (scores and
# probabilities forward; plus dP and dS backward), calibrated against measured RSS.
NAIVE_MATRICES = {"fwd": 2.5, "fwd+bwd": 4.5}
BASE_BYTES = 0.6e9  # jax runtime, compiled code, inputs


def _child(impl: str, mode: str, length: int, repeats: int, cap: int, mask: str) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import jax
    import jax.numpy as jnp

    from hlotool.kernels import get

    kernel = get("reference" if impl == "naive" else "chunked")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (B, length, H, D), jnp.float32) for key in keys)
    window = _window(mask)
    if impl == "naive":
        def attend(q, k, v):  # the plain formula, as a user writes it
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
            if mask != "none":
                i, j = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
                keep = (j <= i) if window is None else (j <= i) & (j > i - window)
                s = jnp.where(keep, s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    else:
        def attend(q, k, v):
            return kernel(q, k, v, scale=D**-0.5, causal=mask != "none",
                          window=_kernel_window(mask))
    if mode == "fwd":
        fn = jax.jit(attend)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
    start = time.perf_counter()
    jax.block_until_ready(fn(q, k, v))
    compile_and_first = time.perf_counter() - start
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(q, k, v))
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": best, "cpu_seconds": best_cpu, "first_call_s": compile_and_first,
            "peak_bytes": peak}


def _window(mask: str) -> int | None:
    return int(mask.split(":")[1]) if mask.startswith("window:") else None


def _kernel_window(mask: str) -> tuple[int, int] | None:
    """`window:W` as the kernels take it: each query sees itself and the W - 1 keys before."""
    window = _window(mask)
    return None if window is None else (window - 1, 0)


def _chunked_call(length: int, mask: str):
    """The chunked kernel under `mask` as attend(q, k, v), and random q, k, v, dO."""
    import jax
    import jax.numpy as jnp

    from hlotool.kernels import get

    kernel = get("chunked")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (B, length, H, D), jnp.float32) for key in keys)

    def attend(q, k, v):
        return kernel(q, k, v, scale=D**-0.5, causal=mask != "none",
                      window=_kernel_window(mask))

    return attend, (q, k, v, do)


def _seconds(fn, *args) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _paired_rates(length: int, repeats: int, runs: dict) -> dict:
    """{name: (median GFLOP/s·1e9, median ratio to the block-matmul rate)} of each of `runs`
    ({name: (flops, fn, args)}), and "mm": the median block-matmul rate; each run paired
    with a block-matmul call just before it, so slow phases of a shared machine hit both."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    q_h, k_h = (jax.random.normal(key, (H, length, D), jnp.float32) for key in keys)
    blocks, steps = max(1, length // 512), 64

    @jax.jit
    def matmuls(q_h, k_h):
        def step(t, acc):
            a = lax.dynamic_slice_in_dim(q_h, (t % blocks) * 512, 512, 1)
            b = lax.dynamic_slice_in_dim(k_h, (t // blocks % blocks) * 512, 512, 1)
            return acc + jnp.einsum("hqk,hkd->hqd", jnp.einsum("hqd,hkd->hqk", a, b), b)
        return lax.fori_loop(0, steps, step, jnp.zeros((H, 512, D), jnp.float32))

    for _, fn, args in [(None, matmuls, (q_h, k_h)), *runs.values()]:
        _seconds(fn, *args)  # compile
    mm_flops = steps * 2 * (2 * H * 512 * 512 * D)
    rows = {"mm": [], **{name: [] for name in runs}}
    for _ in range(repeats):
        for name, (flops, fn, args) in runs.items():
            mm_rate = mm_flops / _seconds(matmuls, q_h, k_h)
            rate = flops / _seconds(fn, *args)
            rows["mm"].append(mm_rate)
            rows[name].append((rate, rate / mm_rate))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"mm": median(rows["mm"]),
            **{name: (median([r for r, _ in rows[name]]), median([x for _, x in rows[name]]))
               for name in runs}}


def _pair_flops(length: int, mask: str) -> int:
    """2·D flops per visible query-key pair: one matmul's work on the visible scores."""
    window = _window(mask)
    visible = sum(min(length, i + 1) if window is None else min(window, i + 1)
                  for i in range(length)) if mask != "none" else length * length
    return 2 * D * B * H * visible


def _rates(length: int, repeats: int, cap: int, mask: str) -> dict:
    """Median ratios of the chunked kernel's forward and backward rate to the block-matmul
    rate."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import jax

    attend, (q, k, v, do) = _chunked_call(length, mask)
    _, vjp = jax.vjp(attend, q, k, v)
    pair_flops = _pair_flops(length, mask)
    return _paired_rates(length, repeats, {
        "fwd": (2 * pair_flops, jax.jit(attend), (q, k, v)),
        "bwd": (5 * pair_flops, jax.jit(lambda vjp, do: vjp(do)), (vjp, do))})


def _floors(length: int, repeats: int, cap: int, mask: str) -> dict:
    """Rates of loops that do less than the chunked forward, over the very tiles it computes
    (its block sizes, the key blocks its loop bounds visit): the tile's two matmuls alone;
    plus a softmax of each tile on its own (row max, exp, row sum: no running state); plus
    the running max, normalizer and output carried from tile to tile (online softmax); and
    the kernel's forward itself, which adds the band on edge tiles, per-block layout changes
    and the output writes. Each as a median ratio to the block-matmul rate."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import jax
    import jax.numpy as jnp
    from jax import lax

    from hlotool.kernels import get
    from hlotool.kernels.base import key_block_span
    # the kernel's own block sizes for a length, and its row max on this XLA:CPU
    from hlotool.kernels.chunked import _block, _row_max
    from hlotool.site import band_of

    attend, (q, k, v, _) = _chunked_call(length, mask)
    kernel = get("chunked")
    bq, bk = _block(length, kernel.block_q), _block(length, kernel.block_k)
    band = band_of(mask != "none", _kernel_window(mask))
    tiles = [(i, j) for i in range(length // bq)
             for j in range(*key_block_span(i, length // bk, bq, bk, band))]
    operands = (*(jnp.swapaxes(x[0], 0, 1) for x in (q, k, v)),  # [H, L, D]
                *(jnp.array(x, jnp.int32) for x in zip(*tiles)))

    def loop(tile, init):
        def run(q_h, k_h, v_h, rows, cols):
            def step(t, carry):
                a = lax.dynamic_slice_in_dim(q_h, rows[t] * bq, bq, 1)
                kb, vb = (lax.dynamic_slice_in_dim(x, cols[t] * bk, bk, 1) for x in (k_h, v_h))
                return tile(jnp.einsum("hqd,hkd->hqk", a, kb), vb, carry)
            return lax.fori_loop(0, len(tiles), step, init)
        return jax.jit(run)

    zeros = jnp.zeros((H, bq, D), jnp.float32)
    out = lambda p, vb: jnp.einsum("hqk,hkd->hqd", p, vb)  # noqa: E731

    def alone(s, vb, acc):  # normalized with the tile's own max and sum
        p = jnp.exp(s - _row_max(s)[..., None])
        return acc + out(p, vb) / jnp.sum(p, axis=-1, keepdims=True)

    def online(s, vb, carry):
        m, l, acc = carry
        m_new = jnp.maximum(m, _row_max(s))
        p, corr = jnp.exp(s - m_new[..., None]), jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + out(p, vb)

    flops = 2 * _pair_flops(length, mask)
    row0 = jnp.full((H, bq), -1e30, jnp.float32)
    r = _paired_rates(length, repeats, {
        "matmuls": (flops, loop(lambda s, vb, acc: acc + out(s, vb), zeros), operands),
        "softmax": (flops, loop(alone, zeros), operands),
        "online": (flops, loop(online, (row0, jnp.zeros_like(row0), zeros)), operands),
        "fwd": (flops, jax.jit(attend), (q, k, v))})
    return {**r, "tiles": len(tiles), "blocks": (bq, bk)}


# What an XLA:CPU op does (`_op_classes`), by the opcodes of its fused computation: the first
# class whose opcodes it has, else data movement if it has only those, else elementwise.
_CLASSES = ("matmul", "exp", "reduce", "data movement", "elementwise")
_MARKS = {"matmul": {"dot", "convolution"}, "exp": {"exponential"}, "reduce": {"reduce"}}
_MOVES = {"parameter", "copy", "dynamic-slice", "dynamic-update-slice", "transpose", "bitcast",
          "broadcast", "slice", "reshape", "constant", "tuple", "get-tuple-element",
          "concatenate", "pad"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(")


def _op_classes(hlo: str) -> dict[str, str]:
    """The class (`_CLASSES`) of each op of an optimized HLO module, by instruction name;
    loops and calls, whose trace events hold their bodies' ops, have none."""
    bodies: dict[str, list[tuple[str, str, list[str]]]] = {}
    current = None
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            words = line.split()
            current = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            bodies[current] = []
        elif current is not None and (m := _INSTRUCTION.match(line)):
            bodies[current].append((m[1], m[2], re.findall(r"calls=%?([\w.\-]+)", line)))
    classes = {}
    for instructions in bodies.values():
        for name, opcode, called in instructions:
            if opcode in ("while", "conditional", "call"):
                continue
            ops = {op for c in called for _, op, _ in bodies.get(c, ())} or {opcode}
            classes[name] = next((c for c in ("matmul", "exp", "reduce") if ops & _MARKS[c]),
                                 "data movement" if ops <= _MOVES else "elementwise")
    return classes


def _breakdown(length: int, repeats: int, cap: int, mask: str) -> dict:
    """Per class, the seconds per call the forward and the backward spend in XLA:CPU ops."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import glob
    import gzip
    import tempfile

    import jax

    attend, (q, k, v, do) = _chunked_call(length, mask)

    _, vjp = jax.vjp(attend, q, k, v)  # the backward alone, from the forward's residuals
    out = {}
    for name, fn, args in (("fwd", jax.jit(attend), (q, k, v)),
                           ("bwd", jax.jit(lambda vjp, do: vjp(do)), (vjp, do))):
        classes = _op_classes(fn.lower(*args).compile().as_text())
        jax.block_until_ready(fn(*args))
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(repeats):
                    jax.block_until_ready(fn(*args))
            (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
            events = json.load(gzip.open(path))
        events = events["traceEvents"] if isinstance(events, dict) else events
        seconds = dict.fromkeys(_CLASSES, 0.0)
        for e in events:
            if e.get("ph") == "X" and e.get("name") in classes:
                seconds[classes[e["name"]]] += e.get("dur", 0) / 1e6 / repeats
        out[name] = seconds
    return out


def _children(flag: str, args, cap: int):
    """(length, result) of a child process `flag` per length, each in its own process; a
    failed child is printed as such and skipped."""
    for length in map(int, args.lengths.split(",")):
        cmd = [sys.executable, __file__, flag, str(length), str(args.repeats), str(cap),
               args.mask]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
            print(f"{length:>6}  failed: {tail}", flush=True)
            continue
        yield length, json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> str:
    """CPUs and jax version: XLA:CPU's code for the same kernel differs between jax versions
    (a row max ran 10× slower in jax 0.9.0's than in 0.10.2's)."""
    return f"{os.cpu_count()} CPUs, jax {importlib.metadata.version('jax')}"


def _print_breakdown(args, cap: int) -> None:
    names = list(_CLASSES)
    print(f"B={B} H={H} D={D} float32, mask {args.mask}: ms per call in XLA:CPU ops by class "
          f"(share), {args.repeats} calls traced; {_machine()}")
    widths = (6, 5) + (15,) * len(names) + (9,)
    header = ("L", "pass", *names, "ops ms")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), flush=True)
    for length, r in _children("--breakdown-child", args, cap):
        for name in ("fwd", "bwd"):
            total = sum(r[name].values())
            cells = [f"{r[name][c] * 1e3:.1f} ({r[name][c] / total:.0%})" for c in names]
            row = (str(length), name, *cells, f"{total * 1e3:.1f}")
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def _print_floors(args, cap: int) -> None:
    print(f"B={B} H={H} D={D} float32, mask {args.mask}: the chunked forward's rate of visible "
          f"work and that of loops doing less over its tiles, as ratios to the block-matmul "
          f"rate; medians of {args.repeats} paired runs; {_machine()}")
    header = ("L", "tiles", "block mm", "matmuls", "+softmax", "+online", "kernel fwd")
    widths = (6, 16, 9, 8, 9, 8, 11)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), flush=True)
    for length, r in _children("--floors-child", args, cap):
        tiles = f"{r['tiles']} of {r['blocks'][0]}x{r['blocks'][1]}"
        row = (str(length), tiles, f"{r['mm'] / 1e9:.0f}",
               *(f"{r[name][1]:.2f}" for name in ("matmuls", "softmax", "online", "fwd")))
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def _print_rates(args, cap: int) -> None:
    print(f"B={B} H={H} D={D} float32, mask {args.mask}: GFLOP/s of visible work; ratios to "
          f"the block-matmul rate, medians of {args.repeats} paired runs; {_machine()}")
    header = ("L", "block mm", "fwd", "fwd/mm", "bwd", "bwd/mm")
    widths = (6, 9, 6, 7, 6, 7)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), flush=True)
    for length, r in _children("--rates-child", args, cap):
        row = (str(length), f"{r['mm'] / 1e9:.0f}", f"{r['fwd'][0] / 1e9:.0f}",
               f"{r['fwd'][1]:.2f}", f"{r['bwd'][0] / 1e9:.0f}", f"{r['bwd'][1]:.2f}")
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def _run(impl: str, mode: str, length: int, repeats: int, cap: int, mask: str) -> dict:
    if impl == "naive":
        need = NAIVE_MATRICES[mode] * B * H * length * length * 4 + BASE_BYTES
        if need > cap:
            return {"skipped": f"OOM (needs ≈{need / 1e9:.0f} GB)"}
    cmd = [sys.executable, __file__, "--child", impl, mode, str(length), str(repeats),
           str(cap), mask]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
        return {"skipped": f"failed under the {cap / 2**30:.0f} GiB cap: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(r: dict) -> tuple[str, str]:
    if "skipped" in r:
        return r["skipped"], "-"
    return (f"{r['seconds']:.2f} s ({r['cpu_seconds']:.2f})",
            f"{r['peak_bytes'] / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cap-gb", type=float, default=12.0,
                        help="address-space cap per child process, GiB")
    parser.add_argument("--mask", default="none",
                        help="none, causal or window:W (causal, W keys per query)")
    parser.add_argument("--rates", action="store_true",
                        help="the chunked kernel's forward and backward GFLOP/s against the "
                             "block-matmul rate measured in the same process")
    parser.add_argument("--breakdown", action="store_true",
                        help="where the chunked kernel's forward and backward spend their time, "
                             "by class of XLA:CPU op (matmul, exp, reduce, data movement, "
                             "elementwise)")
    parser.add_argument("--floors", action="store_true",
                        help="the chunked forward's rate beside loops that do less over the "
                             "same tiles (the tiles' matmuls; + a softmax per tile; + the "
                             "online softmax's running state), each against the block-matmul "
                             "rate: how far the kernel is from what blockwise work costs here")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    children = {"rates_child": _rates, "breakdown_child": _breakdown, "floors_child": _floors}
    for name in children:  # each: length repeats cap mask
        parser.add_argument(f"--{name.replace('_', '-')}", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, measure in children.items():
        if getattr(args, name):
            length, repeats, cap, mask = getattr(args, name)
            print(json.dumps(measure(int(length), int(repeats), int(cap), mask)))
            return
    if args.child:
        impl, mode, length, repeats, cap, mask = args.child
        print(json.dumps(_child(impl, mode, int(length), int(repeats), int(cap), mask)))
        return
    if not (args.mask in ("none", "causal") or args.mask.startswith("window:")):
        parser.error(f"--mask must be none, causal or window:W, got {args.mask!r}")

    cap = int(args.cap_gb * 2**30)
    if args.rates:
        _print_rates(args, cap)
        return
    if args.breakdown:
        _print_breakdown(args, cap)
        return
    if args.floors:
        _print_floors(args, cap)
        return
    print(f"B={B} H={H} D={D} float32, mask {args.mask}; best of {args.repeats} after warm-up; "
          f"children capped at {args.cap_gb:g} GiB; {_machine()}")
    header = ("L", "pass", "naive time", "naive peak", "chunked time", "chunked peak",
              "time ratio", "peak ratio")
    widths = (6, 8, 22, 11, 16, 13, 11, 11)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), flush=True)
    for length in map(int, args.lengths.split(",")):
        for mode in args.modes.split(","):
            naive = _run("naive", mode, length, args.repeats, cap, args.mask)
            chunked = _run("chunked", mode, length, args.repeats, cap, args.mask)
            ratios = ("-", "-")
            if "skipped" not in naive and "skipped" not in chunked:
                ratios = (f"{chunked['seconds'] / naive['seconds']:.2f}x",
                          f"{chunked['peak_bytes'] / naive['peak_bytes']:.3f}x")
            row = (str(length), mode, *_fmt(naive), *_fmt(chunked), *ratios)
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


if __name__ == "__main__":
    main()
