"""``%vgpu_cluster`` and ``%vgpu_run`` / ``%%vgpu_run``: thin faces over :class:`~.rank_cluster.RankCluster`."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments

from ..errors import USER_ERRORS, PlanError
from ..frameworks import choices
from ..grammar import choice, framework_name, parse_arguments, parse_memory, seconds, usage_errors, whole
from ..planner import MAX_DEVICES
from ..units import MIB
from .doctor import HANG_AFTER
from .launchers import LAUNCHERS, MAX_RANKS
from .spec import ClusterNotRunning, checked_faults

__all__ = ["ClusterMagics"]

#: The launcher options the magic has a flag for, and the launchers that take each.
_LAUNCHER_FLAGS = {
    key: [name for name, other in LAUNCHERS.items() if key in other.options]
    for launcher in LAUNCHERS.values()
    for key, flag in launcher.options.items()
    if flag
}

_ACTIONS = ("start", "status", "log", "stop", "restart")
_START = "%vgpu_cluster start 2 --framework torch"
#: Seconds ``--timeout`` accepts: up to a week of training.
_MAX_TIMEOUT = 7 * 24 * 3600.0
#: N is a rank count for ``start`` and a rank for ``log``.
_RANK_COUNT = whole("rank count", 1, MAX_RANKS, _START)
_RANK = whole("rank", 0, MAX_RANKS - 1, "%vgpu_cluster log 1")
_PORT = whole("--port", 1, 65535, "--port 29500")


def _parse(magic: Any, line: str, example: str) -> argparse.Namespace:
    with usage_errors(PlanError):
        return parse_arguments(magic.parser, line, example=example)


def _launcher_flags(magic: Any) -> Any:
    """Each launcher's flags, a group per launcher (a shared flag in the first one's). Put below every other
    ``@argument``: what follows a group in the parser joins it."""
    decorators = []
    for launcher in LAUNCHERS.values():
        flags = [key for key, flag in launcher.options.items() if flag and _LAUNCHER_FLAGS[key][0] == launcher.name]
        decorators += [argument_group(f"--launcher {launcher.name}")] if flags else []
        for key in flags:
            shared = f" ({' or '.join(_LAUNCHER_FLAGS[key])})" if len(_LAUNCHER_FLAGS[key]) > 1 else ""
            flag = launcher.options[key]
            decorators.append(argument(f"--{key.replace('_', '-')}", **{**flag, "help": flag["help"] + shared}))
    # magic_arguments reads its decorators last applied first.
    for decorator in reversed(decorators):
        magic = decorator(magic)
    return magic


@magics_class
class ClusterMagics(Magics):
    """``%vgpu_cluster`` and ``%%vgpu_run``."""

    @magic_arguments()
    @argument(
        "action",
        type=choice(_ACTIONS, "{value} is not an action; use start, status, log, stop or restart", _START),
        help="start N ranks, show their status or the start-up lines they held back (log [RANK]), stop or restart",
    )
    @argument("n", nargs="?", help="number of ranks (start); the rank whose held-back lines to show (log)")
    @argument("--framework", "-f", type=framework_name, help=f"{choices()}: how the ranks are wired")
    @argument(
        "--split",
        type=whole("--split", 1, MAX_DEVICES, "--split 2"),
        help="TensorFlow on GPU: logical GPUs per worker; JAX on CPU: CPU devices per process",
    )
    @argument("--memory", help="per-rank GPU memory cap (2048 = MiB, 2GB, 1.5G); default an even share")
    @argument("--port", type=_PORT, help="coordinator port (default: a free port from the OS)")
    @argument(
        "--launcher",
        type=choice(LAUNCHERS, "--launcher {value} is not a launcher; use " + ", ".join(LAUNCHERS), "--launcher ssh"),
        help=f"how ipyparallel starts the engines: {', '.join(LAUNCHERS)} (default local; their options below)",
    )
    @argument(
        "--join",
        action="store_true",
        help="join the ranks for your code at start (init_process_group / jax.distributed.initialize); "
        "by default your code makes that call, as under its launcher",
    )
    @argument(
        "--verbose",
        action="store_true",
        help="show the ranks' framework start-up lines too (held back by default: %%vgpu_cluster log)",
    )
    @argument(
        "--backend",
        type=choice(("gloo", "nccl"), "--backend {value} is not a backend; use gloo or nccl", "--backend nccl"),
        help="torch's collectives: nccl lets ranks share a GPU over NCCL 2.30+ (experimental); default gloo there",
    )
    @argument("--mps", action="store_true", help="with --backend nccl: refuse to start without an MPS daemon")
    @_launcher_flags
    @line_magic
    def vgpu_cluster(self, line: str) -> None:
        """Start, inspect, stop or restart the ranks.

        ::

            %vgpu_cluster start 2 --framework torch
            %vgpu_cluster start 2 --framework jax --split 2
            %vgpu_cluster start 2 --framework torch --launcher mpi   # engines started by mpiexec
            %vgpu_cluster start 4 --framework torch --launcher slurm --partition gpu --time 30
            %vgpu_cluster start 2 --framework jax --launcher ssh --hosts node1,node2
            %vgpu_cluster start 2 --framework torch --join   # init_process_group() done for you
            %vgpu_cluster start 2 --framework torch --backend nccl   # two ranks on one GPU over NCCL 2.30+
            %vgpu_cluster status
            %vgpu_cluster log 1      # rank 1's framework start-up lines, held back from the cells' output
            %vgpu_cluster restart
            %vgpu_cluster stop
        """
        args = _parse(self.vgpu_cluster, line, _START)
        if args.n is not None:
            with usage_errors(argparse.ArgumentTypeError):
                args.n = (_RANK if args.action == "log" else _RANK_COUNT)(args.n)
        from . import rank_cluster

        running = rank_cluster.current()
        if args.action == "start":
            _start(args, _launcher_options(args), running)
            return
        _refuse_start_options(self.vgpu_cluster.parser, args)
        if running is None:
            if args.action == "restart":
                raise UsageError("no cluster to restart; start one with %vgpu_cluster start 2 --framework torch")
            print("no cluster running; start one with %vgpu_cluster start 2 --framework torch")
            return
        if args.action == "status":
            print("\n".join(running.describe()))
        elif args.action == "log":
            with usage_errors(ValueError):
                held = running.log(args.n)
            print("\n".join(held) or "nothing held back (every line the ranks wrote was shown)")
        elif args.action == "stop":
            running.stop()
            print(f"stopped {running.n} {running.label} rank{'s' if running.n > 1 else ''}")
        else:
            with usage_errors():
                running.restart()
            print("\n".join(running.describe()))

    @magic_arguments()
    @argument(
        "-o", "--output", metavar="NAME", help="store the cell's last value on each rank as NAME, a list in rank order"
    )
    @argument(
        "--timeout",
        type=seconds("--timeout", 0.001, _MAX_TIMEOUT, "600"),
        help="seconds the run may take before every rank is interrupted",
    )
    @argument(
        "--hang-after",
        type=seconds("--hang-after", 0, _MAX_TIMEOUT, "30"),
        default=HANG_AFTER,
        help="report a hang when a rank waits this long in a collective another never entered (0: never)",
    )
    @argument("--no-plot", action="store_true", help="no live per-rank memory plot")
    @argument("-m", "--module", action="store_true", help="SCRIPT is a module, run as torchrun -m (python -m) does")
    @argument(
        "--max-restarts",
        type=whole("--max-restarts", 0, 100, "--max-restarts 2"),
        default=0,
        help="line form: launch every rank again when one fails, up to N times, as torchrun --max-restarts N",
    )
    @argument(
        "--fail",
        action="append",
        default=[],
        metavar="RANK@SECONDS[:SIGNAL]",
        help="line form: kill that rank's process that many seconds into the first launch (SIGKILL: a lost node)",
    )
    @argument(
        "--preempt",
        metavar="SECONDS[:GRACE]",
        help="line form: SIGTERM every rank SECONDS in, SIGKILL GRACE s later (default 30), as SLURM preempts",
    )
    @argument("script", nargs="?", help="line form: a script to run on every rank, as torchrun runs it")
    @argument("script_args", nargs=argparse.REMAINDER, help="line form: the script's own arguments (its sys.argv[1:])")
    @line_cell_magic
    def vgpu_run(self, line: str, cell: str | None = None) -> None:
        """Run the cell, or a script, on every rank: notebook names a cell reads are
        sent by value, output streams labelled by rank, and one failing rank stops them all.

        ::

            %%vgpu_run -o losses --timeout 120
            loss = train_one_epoch()
            loss

            %vgpu_run --timeout 600 train.py --epochs 2 --lr 0.1   # a fresh launch, as torchrun's
            %vgpu_run -m pkg.train --epochs 2
            %vgpu_run --max-restarts 2 --fail 1@4 train.py   # rank 1 lost 4 s in; all ranks come back, twice at most
        """
        _refuse_torchrun_options(line)
        args = _parse(self.vgpu_run, line, "%vgpu_run train.py --epochs 2")
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o {args.output!r} is not a Python name; use e.g. -o results")
        if cell is None:
            path = _script_path(args, str((self.shell.user_ns.get("_dh") or ["?"])[-1]))
        elif args.max_restarts or args.fail or args.preempt is not None:
            raise UsageError(
                "--max-restarts, --fail and --preempt launch a script; a cell runs in ranks that keep their state: "
                "%vgpu_run --max-restarts 2 train.py"
            )
        elif args.module:
            raise UsageError("-m runs a module in the line form, e.g. %vgpu_run -m pkg.train; %%vgpu_run runs its cell")
        elif args.script is not None:
            raise UsageError(
                f"{args.script!r}: %%vgpu_run runs its cell; to run a script use the line form, %vgpu_run {args.script}"
            )
        else:
            try:
                # The engines are IPython kernels: `%time ...` and `!cmd` become the calls they run there.
                cell = self.shell.transform_cell(cell)
                compile(cell, "<cell>", "exec")
            except SyntaxError as exc:
                raise UsageError(f"the cell does not parse: {exc.msg} (line {exc.lineno})") from None
        from . import rank_cluster

        running = rank_cluster.current()
        if running is None:
            raise UsageError("no cluster running; start one with %vgpu_cluster start 2 --framework torch")
        kernel = getattr(self.shell, "kernel", None)
        plot = not args.no_plot and kernel is not None and importlib.util.find_spec("matplotlib") is not None
        # The cluster itself refuses a run while it must be restarted.
        with usage_errors(*USER_ERRORS, ClusterNotRunning):
            if cell is None:
                with usage_errors(ValueError):
                    checked_faults(running.n, args.max_restarts, args.fail, args.preempt)
                restarts = {"max_restarts": args.max_restarts, "fail": args.fail, "preempt": args.preempt}
                restarts["hang_after"] = args.hang_after
                running.run_script(path, list(args.script_args), args.timeout, plot, args.module, **restarts)
                return
            # The %%vgpu_run line in front as a comment, so a rank's traceback gives the cell's line numbers.
            values = running.run(
                f"# %%vgpu_run {line}\n{cell}",
                namespace=self.shell.user_ns,
                timeout=args.timeout,
                output=args.output is not None,
                plot=plot,
                hang_after=args.hang_after,
            )
        if args.output is not None:
            self.shell.user_ns[args.output] = values

    def on_unload(self) -> None:
        """``%unload_ext vgpu_magic`` stops the cluster."""
        if "vgpu_magic.ranks.rank_cluster" in sys.modules:
            running = sys.modules["vgpu_magic.ranks.rank_cluster"].current()
            if running is not None:
                running.stop()


def _launcher_options(args) -> dict:
    """The launcher flags given, as ``launcher_options``; a flag for another launcher is a UsageError."""
    options = {key: getattr(args, key) for key in _LAUNCHER_FLAGS if getattr(args, key) is not None}
    launcher = args.launcher or "local"
    wrong = [key for key in options if key not in LAUNCHERS[launcher].options]
    if wrong:
        takes = " or ".join(_LAUNCHER_FLAGS[wrong[0]])
        raise UsageError(f"--{wrong[0].replace('_', '-')} goes with --launcher {takes}, not {launcher}")
    return options


def _refuse_start_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """:class:`UsageError` quoting the first option given that only ``start`` takes (``N`` too, but for ``log``)."""
    unset = vars(parser.parse_args([args.action]))
    for key, value in vars(args).items():
        if key != "action" and value != unset[key] and not (key == "n" and args.action == "log"):
            name = "N" if key == "n" else f"--{key.replace('_', '-')}"
            said = name if value is True or key in _LAUNCHER_FLAGS else f"{name} {value}"
            raise UsageError(f"{said!r} only goes with start, e.g. %vgpu_cluster start 2 --framework torch")


def _start(args: Any, options: dict[str, Any], running: Any) -> None:
    """``%vgpu_cluster start``: the ranks ``args`` ask for, unless ``running`` is that cluster (else stopped first)."""
    from . import rank_cluster

    if args.n is None or args.framework is None:
        raise UsageError("say how many ranks and which framework, e.g. %vgpu_cluster start 2 --framework torch")
    with usage_errors(ValueError):
        memory = parse_memory(args.memory) * MIB if args.memory is not None else None
        asked = {key: getattr(args, key) for key in ("split", "port", "join", "verbose", "backend")}
        asked["mps"] = args.mps or None
        ranks = rank_cluster.RankCluster(
            args.n, args.framework, memory=memory, launcher=args.launcher or "local", launcher_options=options, **asked
        )
    if running is not None and running.runs(ranks.spec):
        # "Run all" re-runs the start cell: keep the ranks and their state rather than start afresh.
        print("already running (%vgpu_cluster restart starts afresh)")
        print("\n".join(running.describe()))
        return
    if running is not None:
        print(f"stopping the running cluster ({running.n} {running.label} rank{'s' if running.n > 1 else ''}) first")
    with usage_errors():
        ranks.start()
    print("\n".join(ranks.describe()))


#: torchrun's options for what the cluster decides (the ranks, their wiring), which ``%vgpu_run`` refuses.
_TORCHRUN_ONLY = {
    *("--nproc-per-node", "--nnodes", "--node-rank", "--standalone", "--master-addr", "--master-port"),
    *("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--monitor-interval"),
    *("--start-method", "--role", "--no-python", "--run-path", "--log-dir", "--redirects", "--tee", "--local-addr"),
}


def _refuse_torchrun_options(line: str) -> None:
    """UsageError quoting a torchrun option given before the script (``--nproc-per-node 2``): the cluster sets that."""
    with contextlib.suppress(ValueError):  # the parser says what is wrong with the quotes
        words = iter(shlex.split(line))
        for word in words:
            if not word.startswith("-"):
                return  # the script: what follows is its own
            if word in ("-o", "--output", "--timeout", "--hang-after"):
                next(words, None)
            if word.split("=")[0].replace("_", "-") in _TORCHRUN_ONLY:
                raise UsageError(
                    f"{word.split('=')[0]!r} is torchrun's: here %vgpu_cluster start N sets the rank count "
                    "and the ranks' wiring; then %vgpu_run train.py (or -m pkg.train) runs on each"
                )


def _script_path(args: Any, last_cd: str) -> str:
    """The script ``%vgpu_run`` runs, as typed (``~`` expanded: its ``sys.argv[0]``), or ``-m``'s module name;
    UsageError where there is none, ``-o`` is given, it is no file, or the kernel's current folder (``last_cd``,
    where the ranks start) was deleted."""
    if args.script is None:
        raise UsageError("say which script to run, e.g. %vgpu_run train.py --epochs 2, or use %%vgpu_run with a cell")
    if args.output is not None:
        raise UsageError("-o takes a cell's last value; a script has none: have it save what you need")
    try:
        os.getcwd()
    except FileNotFoundError:
        raise UsageError(f"the current folder {last_cd!r} is gone; %cd to one that exists, then run again") from None
    if args.module:
        if not all(part.isidentifier() for part in args.script.split(".")):
            raise UsageError(f"-m {args.script!r} is not a module name; use e.g. -m pkg.train")
        return args.script
    path = os.path.expanduser(args.script)
    if not os.path.isfile(path):
        raise UsageError(f"script {args.script!r} is not a file (looked in {os.getcwd()})")
    return path
