"""Run a JAX cell for real on this process's devices and print the most bytes of live
arrays on device 0 right after a jitted call returned (its arguments and outputs, the
part of a step's memory a CPU device can show: it keeps no allocator statistics):
``MEASURED {"live_bytes": ...}``."""

import json
import sys

import jax

jit = jax.jit
most = 0


def measuring_jit(fun=None, **options):
    if fun is None:
        return lambda f: measuring_jit(f, **options)
    jitted = jit(fun, **options)

    def call(*args, **kwargs):
        global most
        out = jax.block_until_ready(jitted(*args, **kwargs))
        first = jax.devices()[0]
        # A buffer can belong to several live arrays (a shard and the array it was put from): count it once.
        buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes
                   for a in jax.live_arrays() for s in a.addressable_shards if s.device == first}  # fmt: skip
        live = sum(buffers.values())
        most = max(most, live)
        return out

    return call


jax.jit = measuring_jit
with open(sys.argv[1]) as f:
    exec(compile(f.read(), sys.argv[1], "exec"), {"__name__": "__main__"})
print("MEASURED", json.dumps({"live_bytes": most}), flush=True)
