"""How much vgpu_magic costs: extension load, split, status.

Run by hand (``make bench``), never by the test suite::

    python benchmarks/load_and_split.py [--repeats 7]

Every figure comes from fresh interpreters, since what matters is the cost in a
new kernel (imports are cached for the life of a process):

(a) ``%load_ext vgpu_magic`` in a fresh shell; goal < 100 ms.
(b) ``%vgpu_split 4`` in a fresh shell, TensorFlow import included, against
    ``import tensorflow`` alone; and the split on its own, timed after the
    import in the same process.
(c) ``%vgpu_status`` before and after TensorFlow's runtime starts.

Medians are reported, with the spread (min..max). One unreported warm-up round
fills the OS file cache first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from fresh_shell import LOADED, SHELL, run_fresh

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
ENV.pop("VGPU_MAGIC_SPLIT", None)

#: (a): only the extension load.
LOAD = (
    SHELL
    + """
ms = timed(shell.run_line_magic, "load_ext", "vgpu_magic")
heavy = [m for m in ("tensorflow", "ipywidgets", "matplotlib") if m in sys.modules]
print(json.dumps({"load_ms": ms, "heavy": heavy}))
"""
)

#: (b) first half and (c): import TensorFlow, then split, then status.
IMPORT_THEN_SPLIT = (
    LOADED
    + """
import_ms = timed(__import__, "tensorflow")
split_ms = timed(shell.run_line_magic, "vgpu_split", "4")
status_ms = timed(shell.run_line_magic, "vgpu_status", "")
import tensorflow as tf
tf.constant(1.0) + 1  # starts the runtime
status_started_ms = timed(shell.run_line_magic, "vgpu_status", "")
print(json.dumps({
    "import_ms": import_ms,
    "split_ms": split_ms,
    "status_ms": status_ms,
    "status_started_ms": status_started_ms,
}))
"""
)

#: (b) second half: the split as a user meets it in a new kernel, import included.
SPLIT_WITH_IMPORT = (
    LOADED
    + """
assert "tensorflow" not in sys.modules
split_ms = timed(shell.run_line_magic, "vgpu_split", "4")
print(json.dumps({"split_with_import_ms": split_ms}))
"""
)


def run(code: str) -> dict:
    return run_fresh(code, ENV)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ms  (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per measurement (default 7)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    run(LOAD)
    run(IMPORT_THEN_SPLIT)  # warm-up: OS file cache
    loads, imports, splits, statuses, statuses_started, splits_with_import = [], [], [], [], [], []
    heavy: set[str] = set()
    for i in range(args.repeats):
        print(f"\rround {i + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
        load = run(LOAD)
        loads.append(load["load_ms"])
        heavy.update(load["heavy"])
        # Alternate which TensorFlow process goes first, so neither always finds a warmer cache.
        if i % 2:
            splits_with_import.append(run(SPLIT_WITH_IMPORT)["split_with_import_ms"])
        staged = run(IMPORT_THEN_SPLIT)
        imports.append(staged["import_ms"])
        splits.append(staged["split_ms"])
        statuses.append(staged["status_ms"])
        statuses_started.append(staged["status_started_ms"])
        if not i % 2:
            splits_with_import.append(run(SPLIT_WITH_IMPORT)["split_with_import_ms"])
    print(file=sys.stderr)

    med = statistics.median
    load_ms = med(loads)
    print(f"vgpu_magic benchmark — Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, medians of fresh processes")
    print()
    print("(a) %load_ext vgpu_magic")
    print(f"    load                          {summary(loads)}")
    verdict = "meets" if load_ms < 100 else "MISSES"
    print(f"    goal < 100 ms: {verdict} ({load_ms / 100:.2f} x the budget)")
    print(f"    heavy modules imported at load: {', '.join(sorted(heavy)) or 'none'}")
    print()
    print("(b) %vgpu_split 4 (CPU: 4 logical CPUs)")
    print(f"    import tensorflow alone       {summary(imports)}")
    print(f"    split incl. TF import         {summary(splits_with_import)}")
    print(f"    split after TF import         {summary(splits)}")
    with_import, alone = med(splits_with_import), med(imports)
    spread = max(imports) - min(imports)
    print(f"    split incl. import / import alone = {with_import / alone:.3f} ({with_import - alone:+.1f} ms", end="")
    print(", within the import's own spread)" if abs(with_import - alone) < spread else ")")
    print(f"    split overhead excluding the import: {med(splits):.1f} ms = {med(splits) / alone:.4f} x the import")
    print()
    print("(c) %vgpu_status (TensorFlow already imported)")
    print(f"    before the runtime starts     {summary(statuses)}")
    print(f"    after the runtime started     {summary(statuses_started)}")
    print(f"    status / split after import = {med(statuses) / med(splits):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
