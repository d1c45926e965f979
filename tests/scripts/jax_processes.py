"""A multi-process JAX program in the shape of JAX's multi-controller docs: its own
``jax.distributed.initialize()`` (no arguments: the launcher's environment says where),
one collective over every process' devices, and a result each process writes to
``OUT.PROCESS`` (tests/test_cluster_frameworks.py runs it twice in a row with ``%vgpu_run``)."""

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
jax.distributed.initialize()
gathered = multihost_utils.process_allgather(jnp.arange(jax.local_device_count()) + 10 * jax.process_index())
seen = [jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count()]
with open(f"{args.out}.{jax.process_index()}", "w") as f:
    json.dump({"seen": seen, "gathered": gathered.ravel().tolist()}, f)
print("process", jax.process_index(), "of", jax.process_count())
