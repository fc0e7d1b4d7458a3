"""`hlotool doctor`: does this install work, and where it does not, why.

One screen: python, jax, jaxlib and libtpu against the ranges hlotool was tested on (the
installed package's own requirements, so pyproject.toml is their one source); each jax hook
of `hlotool.jaxcompat`; each kernel provider; a deviceless compile per TPU target; graphviz's
`dot`. Exits 0 when every feature of this install works. What is merely optional and not
installed (libtpu for TPU targets, tokamax, `dot` for PNG pictures) is listed as "off",
with how to get it; a version outside the tested range that still passes every check is a
warning.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import shutil
import subprocess
import sys
import time
import warnings

import click

from hlotool.report.console import Term

OK, WARN, OFF, FAIL = "ok", "warn", "off", "FAIL"


@dataclasses.dataclass(frozen=True)
class Check:
    what: str  # "jax 0.12.0.1", "hook jit lowering", "kernel pallas_tpu", ...
    status: str  # OK, WARN, OFF or FAIL
    detail: str


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_ranges() -> dict[str, str] | None:
    """Distribution name → the version specifier hlotool's metadata requires ("python" from
    its classifiers: "3.11, 3.12, 3.13"); None when hlotool is not installed."""
    try:
        meta = importlib.metadata.metadata("hlotool")
    except importlib.metadata.PackageNotFoundError:
        return None
    ranges = {}
    for req in meta.get_all("Requires-Dist") or ():
        name, spec = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)", req).groups()
        clauses = [c.strip() for c in spec.strip().strip("()").split(",") if c.strip()]
        # Lower bound first, as people write ranges (metadata sorts them as text).
        clauses.sort(key=lambda c: not c.startswith(">"))
        ranges.setdefault(name.lower(), ",".join(clauses))
    pythons = [c.rpartition(":: ")[2] for c in meta.get_all("Classifier") or ()
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    ranges["python"] = ", ".join(pythons)
    return ranges


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version: "0.12.0.1" → (0, 12, 0, 1), "2.1rc1" → (2, 1)."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets a PEP 440 specifier list such as ">=0.9.0,<0.13" (the release
    comparisons hlotool's pyproject uses: == != >= <= > <, with ==X.* prefixes)."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.fullmatch(r"(==|!=|>=|<=|>|<)\s*(\S+)", clause).groups()
        if want.endswith(".*"):
            prefix = _release(want[:-2])
            equal = have[: len(prefix)] == prefix
            if equal != (op == "=="):
                return False
            continue
        want_t = _release(want)
        width = max(len(have), len(want_t))
        a, b = have + (0,) * (width - len(have)), want_t + (0,) * (width - len(want_t))
        if not {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b,
                "<": a < b}[op]:
            return False
    return True


def version_checks() -> list[Check]:
    ranges = tested_ranges()
    python = ".".join(map(str, sys.version_info[:3]))
    if ranges is None:
        return [Check(f"python {python}", WARN, "hlotool is not installed (pip install -e .): "
                      "tested ranges unknown")]
    minor = ".".join(map(str, sys.version_info[:2]))
    checks = [Check(f"python {python}", OK if minor in ranges["python"].split(", ") else WARN,
                    f"tested {ranges['python']}")]
    for name in ("jax", "jaxlib", "libtpu"):
        spec, have = ranges.get(name, ""), _version(name)
        if have is None:
            hint = ' (TPU targets: pip install "hlotool[tpu]")' if name == "libtpu" else ""
            checks.append(Check(f"{name} -", OFF if name == "libtpu" else FAIL,
                                f"not installed{hint}"))
            continue
        inside = satisfies(have, spec)
        checks.append(Check(f"{name} {have}", OK if inside else WARN,
                            f"tested {spec}" if inside else f"untested: tested {spec}"))
    return checks


def hook_checks() -> list[Check]:
    from hlotool import jaxcompat

    required = {name for names in jaxcompat.FEATURES.values() for name in names}
    checks = []
    for hook in jaxcompat.HOOKS.values():
        if hook.ok:
            checks.append(Check(f"hook {hook.name}", OK,
                                hook.api + (" (private)" if hook.private else "")))
        elif hook.name in required:
            checks.append(Check(f"hook {hook.name}", FAIL,
                                f"{hook.reason}; {hook.used_by} unavailable"))
        else:
            checks.append(Check(f"hook {hook.name}", WARN, f"{hook.reason}; {hook.without}"))
    return checks


def kernel_checks() -> list[Check]:
    from hlotool import kernels

    checks = []
    for name in kernels.names():
        with warnings.catch_warnings():  # get() warns of an unavailable kernel: reported here
            warnings.simplefilter("ignore")
            kernel = kernels.get(name)
        runs = "/".join(kernel.platforms)
        reason = kernel.unavailable_reason
        no_tiles = kernel.cannot_draw()
        if reason is None and no_tiles is not None:
            checks.append(Check(f"kernel {name}", WARN,
                                f"{runs}; reads dropout masks whole: {no_tiles}"))
        elif reason is None:
            deprecated = getattr(kernel, "deprecated", None)
            drawing = "; draws dropout masks per tile" if kernel.draws else ""
            checks.append(Check(f"kernel {name}", OK,
                                f"{runs}; {deprecated}" if deprecated else runs + drawing))
        else:
            optional = getattr(kernel, "optional", False)
            checks.append(Check(f"kernel {name}", OFF if optional else FAIL, reason))
    return checks


def target_checks() -> list[Check]:
    import jax

    from hlotool.errors import HlotoolError, first_line
    from hlotool.targets import TARGETS, libtpu_missing

    # One row per TPU generation: its one-chip target and its pod slice compile alike.
    families: dict[str, list] = {}
    for target in TARGETS.values():
        if target.deviceless:
            families.setdefault(target.topology.split(":")[0], []).append(target)
    checks = []
    for family in families.values():
        what = "target " + ", ".join(t.name for t in family)
        missing = libtpu_missing(family[0].name)
        if missing is not None:
            checks.append(Check(what, OFF, 'libtpu not installed: pip install "hlotool[tpu]"'))
            continue
        start = time.perf_counter()
        try:
            for target in family:
                sharding = target.sharding()
                x = jax.ShapeDtypeStruct((8, 128), jax.numpy.float32, sharding=sharding)
                jitted = jax.jit(lambda a: a * 2 + 1, in_shardings=sharding,
                                 out_shardings=sharding)
                jitted.trace(x).lower().compile()
        except HlotoolError as e:
            checks.append(Check(what, FAIL, f"{target.name}: {e}"))
        except Exception as e:  # noqa: BLE001 - a compile failure of any kind is the finding
            checks.append(Check(what, FAIL, f"{target.name}: compile failed: {first_line(e)}"))
        else:
            checks.append(Check(what, OK, "compiled deviceless ("
                                + ", ".join(t.topology for t in family)
                                + f") in {time.perf_counter() - start:.1f} s"))
    return checks


def graphviz_check() -> Check:
    """graphviz's `dot` is optional: hlotool draws its pictures itself, and only
    `diff --format png` hands them to `dot`."""
    exe = shutil.which("dot")
    if exe is None:
        return Check("graphviz dot", OFF, "optional, not found: only `diff --format png` "
                     "needs it (apt-get install graphviz)")
    try:
        done = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=30)
        version = (done.stderr or done.stdout).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return Check("graphviz dot", WARN, f"{exe} does not run ({e}): `diff --format png` "
                     "will fail")
    return Check("graphviz dot", OK, f"{exe} ({version}): for `diff --format png`")


def features(checks: list[Check]) -> list[tuple[str, str]]:
    """(feature, status) for what a user does with hlotool, from the checks."""
    from hlotool import jaxcompat

    def worst(prefixes: tuple[str, ...]) -> str:
        found = [c.status for c in checks if c.what.startswith(prefixes)]
        for status in (FAIL, OFF, WARN):
            if status in found:
                return status
        return OK

    capture = FAIL if jaxcompat.missing("capture") else OK
    flash = FAIL if jaxcompat.missing("flash_jit") else OK
    tpu = FAIL if jaxcompat.missing("tpu targets") else worst(("target ",))
    return [("inspect/dump/cost", capture), ("flash_jit", flash), ("TPU targets", tpu),
            ("diff png", worst(("graphviz",)))]


def all_checks() -> list[Check]:
    return [*version_checks(), *hook_checks(), *kernel_checks(), *target_checks(),
            graphviz_check()]


def render(checks: list[Check], term: Term | None = None) -> str:
    """The checks as a table fitted to `term` (default: stdout's terminal), and a summary."""
    from hlotool import __version__
    from hlotool.report.table import format_table

    term = term or Term.of()
    lines = [f"hlotool {__version__} doctor ({sys.executable})", "",
             format_table(("check", "status", "detail"),
                          [(c.what, c.status, c.detail) for c in checks], wrap=(2,),
                          term=term), ""]
    summary = features(checks)
    lines.append(term.wrap("features: " + " · ".join(f"{name} {status}"
                                                      for name, status in summary)))
    failed = [c.what for c in checks if c.status == FAIL]
    off = any(c.status == OFF for c in checks)
    lines.append(term.wrap(
        f"{len(failed)} problem{'s' if len(failed) != 1 else ''}: {', '.join(failed)}"
        if failed else "all features of this install work"
        + (" (off: optional, not installed)" if off else "")))
    return "\n".join(lines)


@click.command(short_help="Check this install: versions, jax hooks, kernels, TPU compiles.")
def doctor() -> None:
    """Check that this install works: python, jax, jaxlib and libtpu against the tested
    ranges, each jax API hlotool hooks into, each kernel provider, a deviceless compile
    for each TPU target, and graphviz's dot (optional: PNG pictures only). Exits 1 when
    something this install offers does not work; optional parts that are not installed
    are listed as off."""
    checks = all_checks()
    click.echo(render(checks))
    sys.exit(1 if any(c.status == FAIL for c in checks) else 0)
