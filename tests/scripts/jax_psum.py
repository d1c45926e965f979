"""A JAX multi-process script as people write one: an argument-less ``jax.distributed.initialize()``,
a sum across every process's devices, then each process's memory figures as one JSON line
(tests/test_gpu_real.py)."""

import json
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from nvml_used import nvml_used

MIB = 2**20

jax.distributed.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("i",))
mine = np.full((jax.local_device_count(),), jax.process_index() + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), mine)
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
work = jax.numpy.ones((1024, 1024)) @ jax.numpy.ones((1024, 1024))
work.block_until_ready()
stats = jax.local_devices()[0].memory_stats() or {}
used = nvml_used()  # before the over-cap allocation below
try:
    over = jax.numpy.zeros(int(os.environ["VGPU_TEST_CAP_MIB"]) * MIB + 64 * MIB, dtype=jax.numpy.uint8)
    over.block_until_ready()
    over_cap = f"allocated {over.size // MIB} MiB"
except Exception as exc:  # noqa: BLE001 - XLA's out-of-memory error is a JaxRuntimeError naming RESOURCE_EXHAUSTED
    over_cap = "RESOURCE_EXHAUSTED" if "RESOURCE_EXHAUSTED" in str(exc) else f"{type(exc).__name__}: {exc}"
print(
    json.dumps(
        {
            "process": jax.process_index(),
            "platform": jax.default_backend(),
            "sum": float(total),
            "bytes_limit": stats.get("bytes_limit"),
            "peak": stats.get("peak_bytes_in_use"),
            "in_use": stats.get("bytes_in_use"),
            "reserved": stats.get("bytes_reserved"),
            "nvml_used": used,
            "over_cap": over_cap,
            "env": {k: v for k, v in os.environ.items() if "MEM_FRACTION" in k or k.startswith("NCCL_")},
        }
    ),
    flush=True,
)
