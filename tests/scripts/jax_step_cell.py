"""A data-parallel JAX training step over every device (the estimate tests' cell)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((len(jax.devices()),), ("data",))
replicated, batch_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


@jax.jit
def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (1024, 1024)), "w2": jax.random.normal(k2, (1024, 1024))}


def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w1"]) @ params["w2"])


@jax.jit
def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


params = jax.device_put(init(jax.random.key(0)), replicated)
x = jax.device_put(jnp.ones((512, 1024)), batch_sharded)
for _ in range(2):
    params = step(params, x)
