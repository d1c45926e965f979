"""``python -m vgpu_magic``: the engine from a terminal.

A split only lasts as long as the process that made it, so the CLI does not apply one: use ``%vgpu_split`` in the
kernel, ``vgpu_magic.split()`` in the script, or ``VGPU_MAGIC_SPLIT`` for kernels started later."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from .frameworks import choices

    parser = argparse.ArgumentParser(prog="python -m vgpu_magic", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="physical and logical devices, memory and runtime state")
    p_status.add_argument("--json", action="store_true", help="print JSON")
    p_status.add_argument("--framework", help=f"only this framework ({choices()})")
    p_plan = sub.add_parser("plan", help="validate a %%vgpu_split line against this machine, configure nothing")
    p_plan.add_argument("line", nargs=argparse.REMAINDER, help="the %%vgpu_split arguments, e.g. 4 --memory 1024")
    args = parser.parse_args(argv)

    from .errors import USER_ERRORS
    from .grammar import parse_split_line
    from .outcomes import execute
    from .report import collect_status

    try:
        if args.command == "status":
            report = collect_status(None, args.framework)
            print(report.to_json() if args.json else report)
            return 0
        # Re-quote each word: a size list given as one argument ("1024, 2048") stays one argument.
        request, _ = parse_split_line(shlex.join(args.line))
        result = execute(request, dry_run=True)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
