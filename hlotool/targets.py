"""Compile targets: the host CPU, and TPU chips compiled for deviceless through libtpu.

A TPU target needs no TPU: `jax.experimental.topologies` describes a single-chip topology
(``v5e:1x1`` …) from libtpu, and a program jitted with replicated `NamedSharding`s on a
1-device mesh of that topology lowers and compiles to real TPU HLO on a CPU-only machine.
Such a program can be inspected, priced and diffed, but not run. libtpu is optional
(``pip install "hlotool[tpu]"``): without it the host target works and a TPU target says
how to get it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from hlotool.errors import HlotoolError, first_line, lookup

if TYPE_CHECKING:
    import jax


class UnknownTargetError(HlotoolError):
    """A target name that is not in `TARGETS`."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a captured program is lowered and compiled."""

    name: str  # what users type: "cpu", "tpu-v5e", ...
    platform: str  # jax platform name: "cpu" | "tpu"
    topology: str | None  # libtpu topology for deviceless compiles, e.g. "v5e:1x1"
    description: str

    @property
    def deviceless(self) -> bool:
        """True when this machine compiles for the target without having one attached."""
        return self.topology is not None

    @property
    def chips(self) -> int:
        """The chips of the target's topology ("v5p:2x2x2": 8); 1 for the host."""
        if self.topology is None:
            return 1
        return math.prod(int(n) for n in self.topology.split(":")[1].split("x"))

    def split(self, sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
        """`sharding` (a script's, on its own devices) laid onto this pod's chips: the same
        mesh axes and partition spec over the topology's devices, so a program split over 8
        host devices compiles split over 8 TPU chips. None for a one-chip target, a mesh
        larger than the pod, or a sharding that is not a NamedSharding."""
        from jax.sharding import NamedSharding

        if not isinstance(sharding, NamedSharding) or self.chips == 1:
            return None
        mesh = sharding.mesh
        if mesh.size > self.chips:
            return None
        import jax
        import numpy as np

        from hlotool import jaxcompat

        topology = _topology(self.topology)
        if mesh.size == self.chips:  # laid out along the pod's links, as jax.make_mesh does
            laid = jaxcompat.make_mesh(topology, mesh.devices.shape, mesh.axis_names)
        else:
            laid = jax.sharding.Mesh(
                np.array(topology.devices[:mesh.size]).reshape(mesh.devices.shape),
                mesh.axis_names)
        return NamedSharding(laid, sharding.spec)

    def sharding(self) -> jax.sharding.Sharding | None:
        """Replicated sharding on a 1-device mesh of the target; None for the host CPU.

        The host needs none: plain `jax.jit` already compiles for the default (CPU) device.
        """
        if self.topology is None:
            return None
        reason = libtpu_missing(self.name)
        if reason is not None:
            raise HlotoolError(reason)
        return _replicated_sharding(self.topology)

    @contextlib.contextmanager
    def lowering(self) -> Iterator[None]:
        """Where programs for this target are lowered: for a TPU, with the topology's chip as
        jax's default device. From jax 0.12 on, Pallas' Mosaic lowering asks which TPU it
        lowers for (the context's abstract device, else the default device), and off a TPU
        the answer would be this host's CPU ("Unsupported TPU device kind: cpu"). A context
        mesh would not do for captured programs: their inner jits lower under the empty
        mesh they were traced in. Nothing runs there: deviceless devices only compile."""
        if self.topology is None:
            yield
            return
        import jax

        with jax.default_device(self.sharding().mesh.devices.flat[0]):
            yield


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cpu", "cpu", None, "host CPU (XLA:CPU)"),
        Target("tpu-v5e", "tpu", "v5e:1x1", "TPU v5e, one chip"),
        Target("tpu-v5p", "tpu", "v5p:1x1x1", "TPU v5p, one chip"),
        Target("tpu-v6e", "tpu", "v6e:1x1", "TPU v6e, one chip"),
        # Pod slices: a program the script split over devices compiles split over their
        # chips (`split`); any other compiles for one of them.
        Target("tpu-v5p-8", "tpu", "v5p:2x2x2", "TPU v5p slice, 8 chips (2x2x2)"),
        Target("tpu-v6e-16", "tpu", "v6e:4x4", "TPU v6e slice, 16 chips (4x4)"),
    )
}


def get_target(name: str | Target) -> Target:
    """The `Target` called `name`; raises `UnknownTargetError` listing the valid names."""
    if isinstance(name, Target):
        return name
    return lookup(TARGETS, name, "target", UnknownTargetError)


def default_jax_platforms() -> None:
    """Keep jax off the TPU probe when the user chose no platform and no TPU is attached.

    With libtpu installed (`hlotool[tpu]`, for deviceless TPU compiles), jax probes
    for a TPU at first use and libtpu prints a screenful of warnings about TPU environment
    variables; on a machine without TPU device files that probe can only fail. An NVIDIA
    GPU with jax's CUDA plugin stays available. Must run before jax initializes backends.
    """
    if "JAX_PLATFORMS" in os.environ or any(map(os.path.exists, _TPU_DEVICE_FILES)):
        return
    cuda = os.path.exists("/dev/nvidia0") and any(
        _installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
    )
    os.environ["JAX_PLATFORMS"] = "cuda,cpu" if cuda else "cpu"


LIBTPU_HINT = 'pip install "hlotool[tpu]"'


def tpu_compiler_loaded() -> bool:
    """Whether this process has libtpu mapped (a deviceless TPU compile loaded it, or jax runs
    on a TPU). XLA:TPU's own attention fusion is probed only then: loading libtpu just to
    decide would make `jax.profiler` crash in the caller's process (`cost.trace`)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libtpu" in f.read()
    except OSError:  # no /proc (not Linux): nothing to check
        return False


def load_tpu_compiler() -> None:
    """Load libtpu for deviceless compiles, where it is installed, so that every decision a
    command makes can probe XLA:TPU's fusion (`tpu_compiler_loaded`); a no-op without it."""
    if _installed("libtpu"):
        with contextlib.suppress(HlotoolError):
            _replicated_sharding(get_target("tpu-v5e").topology)


def libtpu_missing(target: str) -> str | None:
    """Why `target` cannot compile deviceless here for want of libtpu (one line), or None."""
    if _installed("libtpu"):
        return None
    return (f"target {target} compiles deviceless through libtpu, which is not installed: "
            f"{LIBTPU_HINT}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# TPU VMs expose chips as /dev/accel* (v4, v5e) or VFIO groups /dev/vfio/<n> (v5p, v6e).
_TPU_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")


@functools.cache
def _topology(topology: str):
    """The deviceless topology's description (its `devices`), once the sharding made it."""
    from hlotool import jaxcompat

    _replicated_sharding(topology)  # loads libtpu, or says why it cannot
    return jaxcompat.get_topology_desc(topology_name=topology, platform="tpu")


@functools.cache
def _replicated_sharding(topology: str) -> jax.sharding.NamedSharding:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from hlotool import jaxcompat

    # libtpu takes a machine-wide lockfile on load; a deviceless compile drives no chip, so
    # it may share libtpu with other processes (another hlotool, a test run).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_stderr() as noise:
        try:
            topo = jaxcompat.get_topology_desc(topology_name=topology, platform="tpu")
            # One chip of the topology (a pod slice's first): what a program not split over
            # devices runs on.
            mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
        except HlotoolError:
            raise
        except Exception as e:  # libtpu refusing the topology: say why
            detail = first_line(e)
            hint = _last_line(noise())
            raise HlotoolError(
                f"cannot describe TPU topology {topology!r} for a deviceless compile "
                f"(libtpu {_version('libtpu')}): {detail}" + (f" [{hint}]" if hint else "")
            ) from e
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[Callable[[], str]]:
    """Divert file descriptor 2 while libtpu initializes; yields a reader of what it said.

    libtpu writes its warnings from C++ straight to fd 2, so `sys.stderr` redirection
    cannot catch them.
    """
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
