"""``python -m vgpu_magic``: the engine from a terminal.

    python -m vgpu_magic status [--json]
    python -m vgpu_magic plan 4 --memory 1024      # validate a split for this machine

A split only lasts as long as the process that made it, so the CLI does not
apply one: use ``%vgpu_split`` in the kernel, ``vgpu_magic.split()`` in the
script, or ``VGPU_MAGIC_SPLIT`` for kernels started later.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(prog="python -m vgpu_magic", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="physical and logical devices, memory and runtime state")
    p_status.add_argument("--json", action="store_true", help="print JSON")
    p_plan = sub.add_parser("plan", help="validate a %%vgpu_split line against this machine, configure nothing")
    p_plan.add_argument("line", nargs=argparse.REMAINDER, help="the %%vgpu_split arguments, e.g. 4 --memory 1024")
    args = parser.parse_args(argv)

    from . import api
    from .planner import PlanError, parse_split_line

    try:
        if args.command == "status":
            report = api.status()
            print(report.to_json() if args.json else report)
            return 0
        request, _ = parse_split_line(" ".join(args.line))
        result = api.execute(request, dry_run=True)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: TensorFlow is not installed; pip install 'vgpu_magic[cpu]'", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
