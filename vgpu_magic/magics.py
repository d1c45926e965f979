"""The IPython face: ``%vgpu_split`` and ``%vgpu_status``.

Each magic parses its line and calls the engine (:mod:`vgpu_magic.api`);
validation lives in :mod:`vgpu_magic.planner`. User mistakes become a one-line
:class:`~IPython.core.error.UsageError`.
"""

from __future__ import annotations

import os
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Unicode

from . import api
from .planner import PlanError, parse_split_line, split_argument_parser
from .runtime import RuntimeWatcher

__all__ = ["VGPUMagics", "ENV_SPLIT"]

#: Environment variable holding a ``%vgpu_split`` line applied at load.
ENV_SPLIT = "VGPU_MAGIC_SPLIT"

_NO_TF = (
    "TensorFlow is not installed in this kernel; install it with pip install 'vgpu_magic[cpu]' "
    "(or 'vgpu_magic[gpu]' for the CUDA build)"
)


def _warn(text: str) -> None:
    print(f"vgpu_magic warning: {text}", file=sys.stderr)


def _split_doc() -> str:
    return (
        """Split one GPU (or the CPU) into logical TensorFlow devices.

Examples
--------
::

  In [1]: %load_ext vgpu_magic

  In [2]: %vgpu_split 4                  # 4 logical GPUs (memory split evenly), or 4 logical CPUs
  In [3]: %vgpu_split 2 --memory 2048    # 2 logical GPUs of 2048 MiB each
  In [4]: %vgpu_split 3 --memory 1024,2048,512
  In [5]: %vgpu_split 1 --memory 4GB     # cap GPU memory without splitting
  In [6]: %vgpu_split --growth           # memory growth instead of a split
  In [7]: %vgpu_split --visible 0,1 --others keep 2 --memory 1024
  In [8]: %vgpu_split                    # the widget panel (in a notebook)

Run it before any TensorFlow code starts the runtime; afterwards only the
identical split is accepted. Splitting gives no speedup: it is for testing
tf.distribute code.

"""
        + split_argument_parser().format_help()
    )


@magics_class
class VGPUMagics(Magics):
    """``%vgpu_split`` and ``%vgpu_status``; see each magic's ``?`` help."""

    split = Unicode(
        "",
        help=f"A %vgpu_split argument line applied when the extension loads, e.g. '4' or '2 --memory 2048'. "
        f"The environment variable {ENV_SPLIT} overrides it.",
    ).tag(config=True)
    warn_on_load = Bool(True, help="Warn at load when TensorFlow's runtime already started.").tag(config=True)

    def __init__(self, shell=None, watcher: RuntimeWatcher | None = None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.watcher = watcher or RuntimeWatcher(shell)

    # -- %vgpu_split --------------------------------------------------------
    @line_magic
    def vgpu_split(self, line: str = ""):
        if not line.strip():
            return self._show_panel()
        try:
            request, args = parse_split_line(line)
            result = api.execute(request, self.watcher, dry_run=args.dry_run)
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        except ImportError:
            raise UsageError(_NO_TF) from None
        self._report(result, quiet=args.quiet)
        return result if args.return_result else None

    vgpu_split.__doc__ = _split_doc()

    def _show_panel(self) -> None:
        """``%vgpu_split`` alone: display the widget panel (notebooks only)."""
        if getattr(self.shell, "kernel", None) is None:
            raise UsageError(
                "give a device count, e.g. %vgpu_split 4 (see %vgpu_split? for options); "
                "the panel (%vgpu_split alone) needs a notebook"
            )
        try:
            from .split_panel import panel
        except ImportError as exc:
            raise UsageError(str(exc)) from None
        try:
            shown = panel(self.watcher)
        except ImportError:
            raise UsageError(_NO_TF) from None
        from IPython.display import display

        display(shown)

    def _report(self, result, quiet: bool = False) -> None:
        for text in result.warnings:
            _warn(text)
        if quiet or result.status == "blocked":
            return
        verb = {"applied": "configured", "unchanged": "already configured", "planned": "would configure"}[result.status]
        print(f"vgpu_magic: {verb} {result.plan.describe()}")
        for note in result.plan.notes:
            print(f"  note: {note}")
        print(f"  MirroredStrategy will use {result.replicas} replica(s): {', '.join(result.devices)}")
        print(f"  reproduce with: {result.plan.magic_line()}")

    # -- %vgpu_status -------------------------------------------------------
    @line_magic
    def vgpu_status(self, line: str = ""):
        """Show physical and logical devices, caps, memory, replicas and whether
        TensorFlow's runtime started. Never starts the runtime.

        Usage::

          In [1]: %vgpu_status           # HTML table in a notebook, text in a terminal
          In [2]: %vgpu_status --json    # JSON
          In [3]: s = %vgpu_status -r    # also return the StatusReport

        Options: ``--json`` prints JSON; ``-r``/``--return`` returns the report.
        """
        words = line.split()
        unknown = [w for w in words if w not in ("--json", "-r", "--return")]
        if unknown:
            raise UsageError(f"unknown option {unknown[0]!r} for %vgpu_status; use --json and/or -r")
        try:
            report = api.collect_status(self.watcher.state())
        except ImportError:
            raise UsageError(_NO_TF) from None
        if "--json" in words:
            print(report.to_json())
        else:
            from IPython.display import display

            display(report)
        return report if ("-r" in words or "--return" in words) else None

    # -- %vgpu_monitor ------------------------------------------------------
    @magic_arguments()
    @argument("action", nargs="?", default="status", choices=("on", "off", "status"), help="default: status")
    @argument(
        "--display",
        choices=("auto", "rich", "text", "none"),
        default=None,
        help="how each monitor shows memory (default auto: a live plot in a notebook, text elsewhere)",
    )
    @argument("--interval", type=float, default=None, help="seconds between samples (default 0.05)")
    @line_magic
    def vgpu_monitor(self, line: str = ""):
        """Monitor the memory of every logical device in every Keras
        ``fit``/``evaluate``/``predict``, without changing the code.

        Examples
        --------
        ::

          In [1]: %vgpu_monitor on                  # a live plot under every later fit
          In [2]: %vgpu_monitor on --display text   # one line per epoch instead
          In [3]: %vgpu_monitor status
          In [4]: %vgpu_monitor off                 # keras.Model exactly as before

        ``%unload_ext vgpu_magic`` turns it off too. For one call, pass
        ``callbacks=[vgpu_magic.MemoryMonitor()]`` instead.
        """
        from .monitor import auto

        args = parse_argstring(self.vgpu_monitor, line)
        options = {k: v for k, v in (("display", args.display), ("interval", args.interval)) if v is not None}
        if args.action == "status":
            if options:
                raise UsageError("options go with 'on', e.g. %vgpu_monitor on --display text")
            print(auto.status())
            return None
        if args.action == "off":
            auto.disable()
        else:
            try:
                auto.enable(**options)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            except ImportError:
                raise UsageError(_NO_TF) from None
        print(auto.status())
        return None

    # -- load-time behaviour -----------------------------------------------
    def persistent_line(self) -> tuple[str, str] | None:
        """The split line to apply at load and where it came from."""
        env = os.environ.get(ENV_SPLIT, "").strip()
        if env:
            return env, f"${ENV_SPLIT}"
        if self.split.strip():
            return self.split.strip(), "c.VGPUMagics.split"
        return None

    def on_load(self) -> None:
        """Warn if TensorFlow already started, then apply the persistent split."""
        persistent = self.persistent_line()
        state = self.watcher.state()
        if self.warn_on_load and state.started:
            _warn(
                f"TensorFlow's runtime already started ({state.culprit}); %vgpu_split can no longer change "
                "devices. Restart the kernel and load vgpu_magic before any TensorFlow code."
            )
        if state.cuda_holders:
            _warn("this process already holds a CUDA context through " + ", ".join(state.cuda_holders))
        if persistent is None:
            return
        line, source = persistent
        try:
            request, args = parse_split_line(line)
            result = api.execute(request, self.watcher, dry_run=args.dry_run)
        except PlanError as exc:
            _warn(f"{source} = {line!r} was not applied: {exc}")
            return
        except ImportError:
            _warn(f"{source} = {line!r} was not applied: {_NO_TF}")
            return
        print(f"vgpu_magic: applying {source} = {line!r}")
        self._report(result, quiet=args.quiet)
