# The same fixed-seed MultiWorkerMirroredStrategy training, run by two plain processes with TF_CONFIG and
# by %%vgpu_run on 2 ranks (tests/test_cluster_frameworks.py). Each worker computes gradients on its half of
# one fixed data set; the strategy sums them across workers. The last expression is the final weights.
import json
import os

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
task, workers = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
params = [
    tf.Variable(0.3 * tf.random.stateless_normal((8, 16), seed=(0, 1))),
    tf.Variable(tf.zeros(16)),
    tf.Variable(0.3 * tf.random.stateless_normal((16, 1), seed=(0, 2))),
    tf.Variable(tf.zeros(1)),
]
x = tf.random.stateless_normal((64, 8), seed=(1, 2))
y = tf.reduce_sum(x * tf.range(8.0), axis=1, keepdims=True)
xs, ys = x[task * 64 // workers : (task + 1) * 64 // workers], y[task * 64 // workers : (task + 1) * 64 // workers]


def gradients():
    with tf.GradientTape() as tape:
        prediction = tf.tanh(xs @ params[0] + params[1]) @ params[2] + params[3]
        loss = tf.reduce_mean((prediction - ys) ** 2) / workers
    return tape.gradient(loss, params)


for step in range(10):
    summed = [strategy.reduce("SUM", g, axis=None) for g in strategy.run(gradients)]
    for p, g in zip(params, summed):
        p.assign_sub(0.05 * g)
weights = [p.numpy().astype("float64").ravel().tolist() for p in params]
if os.environ.get("PARITY_OUT"):
    with open(f"{os.environ['PARITY_OUT']}.{task}", "w") as f:
        json.dump(weights, f)
weights
