"""JAX: N CPU devices (next to a GPU or without one), and this process's share of a GPU (docs/split.md), with JAX's
device names (``cpu:3``). Importing this module imports neither JAX nor Keras."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import types
from collections.abc import Callable
from typing import Any

from ...devices import Capabilities, ConfigSnapshot, DeviceInventory, GPUInfo, cuda_context_mib
from ...errors import PlanError
from ...inventory import cuda_gpus, cuda_to_nvml_order, cuda_total_bytes, nvml_gpus
from ...units import MIB
from ..base import Framework, Reader, call_before_start
from . import ranks
from .memory import ENV_CLIENT_FRACTION, ENV_FRACTION, MONITOR_BUDGET, LiveArrayBytes, MemoryReader

__all__ = ["CAPABILITIES", "FRAMEWORK", "Jax", "backend_started", "gpu_backend_installed"]

CAPABILITIES = Capabilities(
    name="jax",
    label="JAX",
    install_hint="install it with pip install 'vgpu_magic[jax]'",
    splits_cpu=True,  # a GPU is one device: no logical GPUs, no caps, no visibility choice
    gpu_reserve_mib=cuda_context_mib,  # XLA's own reserve is inside its fraction; the context is outside it
    memory_growth=True,
    growth_with_split=True,
    replicas_by="vgpu_magic.mesh()",
    replicas_on_split_cpu=True,
    # JAX's own words: its backend starts once; jax.devices() lists devices (str(device): "cpu:3"), not replicas.
    runtime_word="backend",
    device_noun="{kind} device",
    split_phrase="{count} {kind} device{s}",
    replica_noun="device",
    host_name="CPU (the host)",
)

CPU_NAME = "/physical_device:CPU:0"
#: JAX's names of its CPU and GPU devices, ``str(jax.devices()[i])``.
DEVICE_NAMES = ("cpu:{}", "cuda:{}")
ENV_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\S*)")
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
#: The line Gloo writes on each rank for each communicator it connects (gloo's ``printConnectivityInfo``), written
#: piece by piece to ``std::cout``: communicators connecting at once on one rank (one per device) interleave their
#: pieces, so a held line is any run of those pieces with some text; each ``GLOO_END`` in it ends one greeting.
GLOO_END = "Expected number of connected peer ranks is : "
#: Digit by digit: ``\d+`` repeated would try every split of a long number before failing (exponential).
_GLOO_PIECES = (r"\[Gloo\] Rank ", " is connected to ", r" peer ranks\. ", re.escape(GLOO_END), r"\d")
GLOO_CONNECTED = rf"(?=.*\D)(?:{'|'.join(_GLOO_PIECES)})+"


def backend_started() -> bool:
    """Has JAX's backend started (devices fixed)? Asks ``xla_bridge``; imports no JAX."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bool(bridge.backends_are_initialized())


def xla_flags_count(flags: str) -> int | None:
    """The ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (the last one, as in XLA), or ``None``."""
    found = _COUNT_FLAG.findall(flags or "")
    return int(found[-1]) if found and found[-1].isdigit() else None


@functools.lru_cache(maxsize=1)
def gpu_backend_installed() -> bool:
    """Is a GPU backend installed for JAX (a ``jax_plugins`` CUDA/ROCm plugin)? Imports nothing."""
    import pkgutil

    try:
        plugins = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return False
    if plugins is None or not plugins.submodule_search_locations:
        return False
    names = [m.name.lower() for m in pkgutil.iter_modules(list(plugins.submodule_search_locations))]
    return any(p in name for name in names for p in _GPU_PLATFORMS)


class Jax(Framework):
    capabilities = CAPABILITIES
    module = "jax"
    keras_backend = "jax"
    join_call = "jax.distributed.initialize()"
    # Gloo, JAX's CPU collectives, greets each new communicator on every rank.
    chatter = (GLOO_CONNECTED,)
    chatter_end = GLOO_END

    def __init__(self) -> None:
        self._peaks: dict[str, int] = {}
        self._counters: dict[str, LiveArrayBytes] = {}

    def imported(self) -> bool:
        """Is JAX in use? TensorFlow imports it too: next to it, once its backend started or ``__main__`` (the
        notebook's or script's globals) holds a JAX module, or a function, class or array of it."""
        if "jax" not in sys.modules:
            return False
        if "tensorflow" not in sys.modules or backend_started():
            return True
        for value in list(getattr(sys.modules.get("__main__"), "__dict__", {}).values()):
            try:
                module = isinstance(value, types.ModuleType)
                names = (value.__name__,) if module else (getattr(value, "__module__", None), type(value).__module__)
            except Exception:  # noqa: BLE001 - a user object whose attributes raise is not JAX's
                continue
            if any(isinstance(n, str) and n.split(".")[0] in ("jax", "jaxlib") for n in names):
                return True
        return False

    def runtime_started(self) -> bool:
        return backend_started()

    def watch_runtime_start(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        bridge = sys.modules.get("jax._src.xla_bridge")
        if bridge is None or backend_started() or not callable(getattr(bridge, "backends", None)):
            return None
        return call_before_start(bridge, "backends", lambda: not backend_started(), callback)

    def estimator(self) -> types.ModuleType:
        from . import estimate

        return estimate

    def _gpu_count(self, nvml: list[dict[str, Any]]) -> int:
        """GPUs JAX has (once started) or will have (NVML and ``CUDA_VISIBLE_DEVICES``, given a GPU backend)."""
        if backend_started():
            jax = sys.modules["jax"]
            try:
                return len(jax.devices("gpu"))
            except RuntimeError:  # no GPU backend
                return 0
        # JAX_PLATFORMS / jax_platforms can rule the GPU out before start.
        chosen = getattr(getattr(sys.modules.get("jax"), "config", None), "jax_platforms", None)
        chosen = chosen or os.environ.get("JAX_PLATFORMS", "")
        allowed = not chosen.strip() or any(p.strip().lower() in _GPU_PLATFORMS for p in chosen.split(","))
        if not nvml or not allowed or not gpu_backend_installed():
            return 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        asked = len(nvml) if visible is None else len(visible.split(","))
        return sum(1 for g in cuda_to_nvml_order(asked, nvml) if g is not None)

    def _gpus(self) -> tuple[tuple[GPUInfo, ...], bool]:
        nvml = nvml_gpus() if (backend_started() or gpu_backend_installed()) else []
        return cuda_gpus(self._gpu_count(nvml), nvml), bool(nvml)

    def probe_inventory(self) -> DeviceInventory:
        jax = self.load()
        gpus, nvml = self._gpus()
        notes = []
        if gpus and not nvml:
            notes.append("NVML unavailable: GPU memory unknown, so --memory cannot be turned into JAX's fraction")
        if backend_started():
            # Asking for the platform before the backend starts would start it.
            notes.append(f"platform: {jax.default_backend()} (jax.devices() has {len(jax.devices())} devices)")
        return DeviceInventory(
            gpus=gpus,
            cpus=1,
            version=getattr(jax, "__version__", None),
            nvml_available=nvml,
            notes=tuple(notes),
            capabilities=CAPABILITIES,
            current=self._snapshot(gpus),
        )

    def _cpu_count(self) -> int | None:
        """The CPU device count configured (once started: in use); ``None`` for JAX's default of one."""
        jax = sys.modules.get("jax")
        if backend_started() and jax is not None:
            count = len(jax.devices("cpu"))
        elif jax is not None and jax.config.jax_num_cpu_devices > 0:
            count = int(jax.config.jax_num_cpu_devices)
        else:
            # Before import, JAX_NUM_CPU_DEVICES becomes the option's value; XLA_FLAGS is read at start.
            env = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
            flag = int(env) if env.isdigit() and int(env) > 0 and jax is None else None
            count = flag if flag is not None else xla_flags_count(os.environ.get("XLA_FLAGS", ""))
        return count if count and count > 1 else None

    def _snapshot(self, gpus: tuple[GPUInfo, ...]) -> ConfigSnapshot:
        logical: dict[str, tuple[int | None, ...]] = {}
        count = self._cpu_count()
        if count is not None:
            logical[CPU_NAME] = (None,) * count
        try:
            fraction = float(os.environ.get(_fraction_name(), "").strip())
        except ValueError:
            fraction = None
        if fraction is not None and 0 < fraction <= 1:
            for gpu in gpus:
                if gpu.total_mib is not None:
                    total = cuda_total_bytes(gpu.index) or gpu.total_mib * MIB
                    logical[gpu.name] = (round(fraction * total / MIB),)
        growth = os.environ.get(ENV_PREALLOCATE, "").strip().lower() in ("false", "0") or (
            os.environ.get(ENV_ALLOCATOR, "").strip().lower() == "platform"
        )
        names, visible = tuple(g.name for g in gpus), tuple(g.index for g in gpus)
        return ConfigSnapshot((CPU_NAME,), names, logical, visible, (growth,) * len(gpus), DEVICE_NAMES)

    def read_configuration(self) -> ConfigSnapshot:
        return self._snapshot(self._gpus()[0])

    def write_configuration(self, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
        """CPU count: ``jax_num_cpu_devices``; GPU cap, growth: ``XLA_PYTHON_CLIENT_*``."""
        jax = self.load()

        def left() -> str:
            name = _fraction_name()
            return f"{self._cpu_count() or 1} CPU device(s), {name}={os.environ.get(name)!r}"

        with self.undone_on_error(left) as undo:
            if old.logical.get(CPU_NAME) != new.logical.get(CPU_NAME):
                before = jax.config.jax_num_cpu_devices
                jax.config.update("jax_num_cpu_devices", len(new.logical.get(CPU_NAME) or ()) or -1)
                undo.append(lambda: jax.config.update("jax_num_cpu_devices", before))
            caps = {n: new.logical[n][0] for n in new.gpu_names if n in new.logical}
            if caps != {n: old.logical[n][0] for n in old.gpu_names if n in old.logical}:
                undo.append(_set_env(_fraction_name(), self._fraction(caps)))
            if any(new.memory_growth) != any(old.memory_growth):
                undo.append(_set_env(ENV_PREALLOCATE, "false" if any(new.memory_growth) else None))

    def _fraction(self, caps: dict[str, int | None]) -> str | None:
        """JAX's fraction for caps in MiB: of the GPU's total as CUDA counts it (else NVML's: the cap lands low)."""
        if not caps:
            return None
        gpus = {g.name: g for g in self._gpus()[0]}
        fractions = set()
        for name, cap in caps.items():
            gpu = gpus.get(name)
            if gpu is None or gpu.total_mib is None:
                raise PlanError(
                    f"the total memory of {name.rsplit('/', 1)[-1].replace('physical_device:', '')} is unknown "
                    f"(NVML unavailable), so a cap cannot become JAX's {_fraction_name()}; set it yourself"
                )
            total = cuda_total_bytes(gpu.index) or gpu.total_mib * MIB
            fractions.add(repr(cap * MIB / total))
        # The planner caps one GPU; the variable applies to every GPU of the process.
        return max(fractions, key=float)

    def memory_readings(self, devices: list[str]) -> dict[str, dict[str, int]]:
        """Current bytes per device; ``peak`` is the allocator's (GPU), else the highest read so far (CPU)."""
        try:
            values = MemoryReader(self.load(), self._peaks, self._counters)(devices)
        except (ValueError, RuntimeError):
            return {}
        return {name: {"current": cur, "peak": peak} for name, (cur, peak) in zip(devices, values)}

    def device_label(self, name: str) -> str:
        """JAX's own name, as ``str(jax.devices()[i])``: ``"/device:CPU:3"`` is ``"cpu:3"``."""
        kind, _, index = name.rpartition("/device:")[2].partition(":")
        return DEVICE_NAMES[kind == "GPU"].format(index)

    def memory_reader(self) -> Reader:
        """A :class:`~.memory.MemoryReader` counting in at most ``MONITOR_BUDGET`` of the time."""
        return MemoryReader(self.load(), self._peaks, self._counters, budget=MONITOR_BUDGET)

    def variable_bytes(self, variable: Any) -> dict[str, int]:
        """Each shard of the array (a Keras variable's ``value``) on its device."""
        out: dict[str, int] = {}
        for shard in getattr(getattr(variable, "value", variable), "addressable_shards", ()):
            device = f"/device:{shard.device.platform.upper()}:{shard.device.id}"
            out[device] = out.get(device, 0) + shard.data.nbytes
        return out

    def holds_cuda_context(self) -> bool:
        bridge = sys.modules.get("jax._src.xla_bridge")
        backends = getattr(bridge, "_backends", None) or {}
        return any(name in _GPU_PLATFORMS for name in backends)

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """XLA's allocator statistics over this process' GPUs, once its GPU backend started."""
        if not self.holds_cuda_context():
            return None
        gpus = [d for d in self.load().local_devices() if d.platform in _GPU_PLATFORMS]
        stats = [d.memory_stats() or {} for d in gpus]
        return sum(s.get("bytes_in_use", 0) for s in stats), sum(s.get("peak_bytes_in_use", 0) for s in stats)

    plan_ranks = ranks.plan_ranks

    def split_devices(self) -> list[Any]:
        """Every CPU device where CPU devices were split (also next to a GPU), else ``jax.devices()``. Starts JAX."""
        jax = self.load()
        return list(jax.devices("cpu") if self._cpu_count() is not None else jax.devices())

    def strategy(self) -> Any:
        """A ``jax.sharding.Mesh`` with one ``"data"`` axis over the split's devices."""
        from .mesh import mesh

        return mesh()


def _fraction_name() -> str:
    """The fraction's variable to write: jaxlib's current name where the user set it, else the older one."""
    return ENV_CLIENT_FRACTION if os.environ.get(ENV_CLIENT_FRACTION, "").strip() else ENV_FRACTION


def _set_env(name: str, value: str | None) -> Any:
    """Set (``None``: remove) an environment variable; return the undo step."""
    before = os.environ.get(name)

    def put(value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    put(value)
    return lambda: put(before)


FRAMEWORK = Jax()
