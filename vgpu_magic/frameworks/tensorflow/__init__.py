"""TensorFlow: logical GPUs with memory caps on one GPU, or logical CPUs; the one module touching ``tf.config``,
with calls that do not start the runtime. Imports no TensorFlow."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from ...devices import Capabilities, ConfigSnapshot, DeviceInventory
from ...inventory import cuda_gpus, nvml_gpus
from ..base import Framework, Reader, call_before_start
from . import ranks

__all__ = ["TensorFlow", "FRAMEWORK", "CAPABILITIES", "system_reserve_mib"]


def system_reserve_mib(free_mib: int, compute_capability: tuple[int, int] | None) -> int:
    """TensorFlow's reserve on each GPU for CUDA (``MinSystemMemory``); an unknown capability counts as newest."""
    if free_mib < 2048:
        return 225
    major = compute_capability[0] if compute_capability else 99
    return next((mib for newest, mib in ((6, 500), (7, 1050), (8, 1536)) if major <= newest), 1800)


CAPABILITIES = Capabilities(
    name="tensorflow",
    label="TensorFlow",
    install_hint="install it with pip install 'vgpu_magic[cpu]' (or 'vgpu_magic[gpu]' for the CUDA build)",
    splits_gpu=True,
    gpu_caps_required=True,
    gpu_reserve_mib=lambda gpu: system_reserve_mib(gpu.free_mib, gpu.compute_capability),
    gpu_visibility=True,
    splits_cpu=True,
    cpus_share_allocator=True,  # every logical CPU reports the one host allocator's figures
    memory_growth=True,
    uniform_growth=True,
    replicas_by="MirroredStrategy()",
    replicas_nccl_unless_fewer_physical=True,
)

_INFO_LINE = re.compile(
    r"^(?:I\d{4} \d\d:\d\d:\d+(?:\.\d+)?\s+\d+ \S+:\d+\] .*"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR)$"
)

#: The start of any C++ log line or absl notice: a line that does not continue the one before.
_LOG_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:|WARNING: |[A-Za-z_.]+Error|Traceback)")

#: The INFO records :meth:`TensorFlow.strategy`'s strategy causes (made, each traced reduction, ``fit``'s first step).
_STRATEGY_INFO = re.compile(
    r"^(Using MirroredStrategy with devices|Reduce to \S+ then broadcast to|Collective all_reduce tensors: )"
)


def _strategy_chatter(record: logging.LogRecord) -> bool:
    """The logger's filter: every record but :data:`_STRATEGY_INFO`'s, the logger's level as the user set it."""
    return not (record.levelno <= logging.INFO and _STRATEGY_INFO.match(str(record.msg)))


@contextlib.contextmanager
def _without_cpp_info_lines() -> Iterator[None]:
    """Send fd 2 to a temporary file, then write back every line but INFO ones."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            kept, dropping = [], False
            for line in text.splitlines(keepends=True):
                bare = line.rstrip("\n")
                # An INFO message, and the lines that continue it.
                dropping = bool(_INFO_LINE.match(bare)) or (dropping and not _LOG_LINE.match(bare))
                if not dropping:
                    kept.append(line)
            if kept:
                os.write(2, "".join(kept).encode())


class TensorFlow(Framework):
    capabilities = CAPABILITIES
    module = "tensorflow"
    keras_backend = "tensorflow"
    # Level 2: no C++ INFO and WARNING lines (runtime start, Keras datasets, gRPC on every worker); errors stay.
    log_settings = {"TF_CPP_MIN_LOG_LEVEL": ("2", "0")}  # noqa: RUF012 - read, never written
    chatter = (
        # Written while TensorFlow is imported, before it reads its level.
        r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
        r"I\d{4} [\d:.]+\s+\d+ port\.cc:\d+\] oneDNN custom operations are on\..*",
        r"I\d{4} [\d:.]+\s+\d+ cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized .*",
        r"To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.",
        # An IPython engine looks interactive to tf_logging, which then logs INFO records to stdout.
        r"INFO:tensorflow:.*",
    )

    def importing(self) -> contextlib.AbstractContextManager:
        """Without the INFO lines TensorFlow writes while imported, unless the user asked for them (an explicit 0)."""
        level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip()
        hidden = not level or (level.isdigit() and int(level) >= 1)
        return _without_cpp_info_lines() if hidden else contextlib.nullcontext()

    def watch_runtime_start(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        if not self.imported() or self.runtime_started():
            return None
        from tensorflow.python.eager import context

        return call_before_start(context.Context, "ensure_initialized", lambda ctx: not ctx._initialized, callback)

    def runtime_started(self) -> bool:
        if "tensorflow" not in sys.modules:
            return False
        try:
            from tensorflow.python.eager import context
        except ImportError:  # a half-imported or broken TensorFlow cannot have started
            return False
        return bool(context.context()._initialized)

    def holds_cuda_context(self) -> bool:
        if not self.runtime_started():
            return False
        tf = sys.modules["tensorflow"]
        try:
            return bool(tf.config.get_visible_devices("GPU"))
        except (AttributeError, RuntimeError):
            return False

    def probe_inventory(self) -> DeviceInventory:
        tf = self.load()
        n_gpus = len(tf.config.list_physical_devices("GPU"))
        n_cpus = len(tf.config.list_physical_devices("CPU"))
        nvml = nvml_gpus() if n_gpus else []
        notes = ("NVML unavailable: GPU memory unknown, give --memory explicitly",) if n_gpus and not nvml else ()
        return DeviceInventory(
            gpus=cuda_gpus(n_gpus, nvml),
            cpus=n_cpus,
            version=tf.__version__,
            nvml_available=bool(nvml),
            notes=notes,
            capabilities=CAPABILITIES,
            current=self.read_configuration(),
        )

    def read_configuration(self) -> ConfigSnapshot:
        tf = self.load()
        cpus = tf.config.list_physical_devices("CPU")
        gpus = tf.config.list_physical_devices("GPU")
        configs = {dev.name: tf.config.get_logical_device_configuration(dev) for dev in cpus + gpus}
        logical = {name: tuple(c.memory_limit for c in found) for name, found in configs.items() if found}
        visible_idx = tuple(gpus.index(d) for d in tf.config.get_visible_devices("GPU") if d in gpus)
        growth = tuple(bool(tf.config.experimental.get_memory_growth(d)) for d in gpus)
        cpu_names, gpu_names = tuple(d.name for d in cpus), tuple(d.name for d in gpus)
        return ConfigSnapshot(cpu_names, gpu_names, logical, visible_idx, growth)

    def write_configuration(self, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
        tf = self.load()

        def set_visible(gpu_indices: tuple[int, ...]) -> None:
            cpus = tf.config.list_physical_devices("CPU")
            gpus = tf.config.list_physical_devices("GPU")
            tf.config.set_visible_devices(cpus + [gpus[i] for i in gpu_indices])

        def set_logical(physical_name: str, limits: tuple[int | None, ...] | None) -> None:
            dev = next(d for d in tf.config.list_physical_devices() if d.name == physical_name)
            if limits is None:
                # An undo: TensorFlow has no public call; set_logical_device_configuration(dev, None) raises TypeError.
                from tensorflow.python.eager import context

                context.context()._virtual_device_map.pop(dev, None)
                return
            configs = [tf.config.LogicalDeviceConfiguration(memory_limit=m) for m in limits]
            tf.config.set_logical_device_configuration(dev, configs)

        def left() -> str:
            now = self.read_configuration()
            return f"logical devices {now.logical or 'unconfigured'}, visible GPUs {list(now.visible_gpus)}"

        with self.undone_on_error(left) as undo:
            if new.visible_gpus != old.visible_gpus:
                set_visible(new.visible_gpus)
                undo.append(lambda: set_visible(old.visible_gpus))
            for name in sorted(set(old.logical) | set(new.logical)):
                if old.logical.get(name) != new.logical.get(name):
                    set_logical(name, new.logical.get(name))
                    undo.append(lambda name=name: set_logical(name, old.logical.get(name)))
            gpus = tf.config.list_physical_devices("GPU")
            for i, (was, want) in enumerate(zip(old.memory_growth, new.memory_growth)):
                if was != want:
                    tf.config.experimental.set_memory_growth(gpus[i], want)
                    undo.append(lambda i=i, was=was: tf.config.experimental.set_memory_growth(gpus[i], was))

    def memory_readings(self, devices: list[str]) -> dict[str, dict[str, int]]:
        tf = self.load()
        out = {}
        for name in devices:
            try:
                info = tf.config.experimental.get_memory_info(name.replace("/device:", ""))
            except (ValueError, RuntimeError):
                continue
            out[name] = {"current": int(info["current"]), "peak": int(info["peak"])}
        return out

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """The BFC allocators' figures over this process' logical GPUs."""
        if not self.holds_cuda_context():
            return None
        readings = self.memory_readings([d.name for d in self.load().config.list_logical_devices("GPU")]).values()
        return sum(r["current"] for r in readings), sum(r["peak"] for r in readings)

    def memory_reader(self) -> Reader:
        """Through the C function under ``get_memory_info``, bound once: each Python level costs as much as the read."""
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import context

        handle = context.context()._context_handle
        info_of = pywrap_tfe.TFE_GetMemoryInfo

        def read(names: list[str]) -> list[tuple[int, int]]:
            return [(info["current"], info["peak"]) for info in (info_of(handle, name) for name in names)]

        return read

    def variable_bytes(self, variable: Any) -> dict[str, int]:
        """A ``MirroredVariable``'s per-replica copies each on its own device, a ``tf.Variable`` on its device."""
        value = getattr(variable, "value", variable)
        if callable(value):  # a tf.Variable: .value is a method, the variable is the value
            value = variable
        parts = getattr(value, "values", None)
        out: dict[str, int] = {}
        for part in parts if isinstance(parts, tuple) and parts else (value,):
            device = "/device:" + part.device.rpartition("device:")[2]
            out[device] = out.get(device, 0) + math.prod(part.shape) * part.dtype.size
        return out

    def strategy(self) -> Any:
        """A ``MirroredStrategy`` over the split's logical devices (starts the runtime), reducing through one device."""
        tf = self.load()
        snap = self.read_configuration()
        shared_gpu = any(len(v) > 1 for k, v in snap.logical.items() if k in snap.gpu_names)
        cross = tf.distribute.ReductionToOneDevice() if shared_gpu else None
        logger = tf.get_logger()
        if _strategy_chatter not in logger.filters:
            logger.addFilter(_strategy_chatter)
        return tf.distribute.MirroredStrategy(devices=snap.replica_devices(), cross_device_ops=cross)

    plan_ranks = ranks.plan_ranks


FRAMEWORK = TensorFlow()
