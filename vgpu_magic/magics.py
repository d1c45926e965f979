"""The IPython face: ``%vgpu_split`` and ``%vgpu_status`` parse their line and call the engine."""

from __future__ import annotations

import numbers
import os
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from traitlets import Any as AnyTrait
from traitlets import Bool

from . import frameworks
from .errors import USER_ERRORS, excerpt
from .grammar import framework_name, parse_arguments, parse_split_line, split_arguments, usage_errors
from .outcomes import as_sentence, execute, print_summary, remedy, runtime_started_lines
from .report import collect_status
from .runtime import RuntimeWatcher

#: Environment variable holding a ``%vgpu_split`` line applied at load.
ENV_SPLIT = "VGPU_MAGIC_SPLIT"


def _warn(text: str) -> None:
    print(f"vgpu_magic warning: {text}", file=sys.stderr)


@magics_class
class VGPUMagics(Magics):
    """``%vgpu_split`` and ``%vgpu_status``; see each magic's ``?`` help."""

    split = AnyTrait(
        "",
        help=f"A %vgpu_split argument line applied when the extension loads, e.g. '4' or '2 --memory 2048' "
        f"(a plain count such as 4 works too). The environment variable {ENV_SPLIT} overrides it.",
    ).tag(config=True)
    warn_on_load = Bool(True, help="Warn at load when a framework's runtime already started.").tag(config=True)

    def __init__(self, shell=None, watcher: RuntimeWatcher | None = None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.watcher = watcher or RuntimeWatcher(shell)

    @line_magic
    @magic_arguments()
    @split_arguments
    def vgpu_split(self, line: str = ""):
        """
        Split one GPU (or the CPU) into logical devices for one framework (see --framework).

        Examples
        --------
        ::

          In [1]: %load_ext vgpu_magic

          In [2]: %vgpu_split 4                  # 4 logical GPUs (memory split evenly), or 4 logical CPUs
          In [3]: %vgpu_split 2 --memory 2048    # 2 logical GPUs of 2048 MiB each
          In [4]: %vgpu_split 3 --memory 1024,2048,512
          In [5]: %vgpu_split 1 --memory 4GB     # cap GPU memory without splitting
          In [6]: %vgpu_split --growth           # memory growth instead of a split
          In [7]: %vgpu_split 8 --framework jax  # 8 JAX CPU devices (also before `import jax`)
          In [8]: %vgpu_split                    # the widget panel (in a notebook)

        Run it before any framework code starts the runtime; afterwards only the identical split is accepted.
        Splitting gives no speedup: it is for testing distributed code.
        """
        with usage_errors():
            request, args = parse_split_line(line, self.vgpu_split.parser)
            says_nothing = request == type(request)(framework=request.framework)
            if says_nothing and not (args.dry_run or args.return_result or args.quiet):
                return self._show_panel(request.framework)
            result = execute(request, self.watcher, dry_run=args.dry_run)
        print_summary(result, quiet=args.quiet)
        return result if args.return_result else None

    def _show_panel(self, framework: str | None = None) -> None:
        """``%vgpu_split`` alone: display the widget panel (notebooks only)."""
        if getattr(self.shell, "kernel", None) is None:
            raise UsageError(
                "give a device count, e.g. %vgpu_split 4 (see %vgpu_split? for options); "
                "the panel (%vgpu_split alone) needs a notebook"
            )
        with usage_errors(ImportError):
            from .split_panel import panel
        with usage_errors():
            shown = panel(self.watcher, framework=framework)
        display(shown)

    @line_magic
    @magic_arguments()
    @argument("--json", action="store_true", help="print JSON instead of the table")
    @argument("--return", "-r", dest="return_result", action="store_true", help="also return the StatusReport")
    @argument(
        "--framework", "-f", type=framework_name, metavar="NAME", help=f"only this framework: {frameworks.choices()}"
    )
    def vgpu_status(self, line: str = ""):
        """
        Show physical and logical devices, caps, memory, replicas and whether each framework's runtime started.
        Never starts the runtime.

        Examples
        --------
        ::

          In [1]: %vgpu_status           # HTML in a notebook, text in a terminal
          In [2]: %vgpu_status --json    # JSON
          In [3]: s = %vgpu_status -r    # also return the StatusReport
          In [4]: %vgpu_status --framework jax

        Every framework imported in the kernel gets a section (or the one ``%vgpu_split`` would configure, if none).
        """
        with usage_errors():
            args = parse_arguments(
                self.vgpu_status.parser,
                line,
                example="%vgpu_status --json",
                options_hint="%vgpu_status takes --json, -r and --framework NAME",
            )
            report = collect_status(self.watcher, args.framework)
        if args.json:
            print(report.to_json())
        else:
            display(report)
        return report if args.return_result else None

    def on_load(self) -> None:
        """Warn about runtimes that already started, then apply the persistent split: ${ENV_SPLIT}, else
        ``c.VGPUMagics.split`` (a line, or a count; anything else is reported in one line and ignored)."""
        line, source = os.environ.get(ENV_SPLIT, "").strip(), f"${ENV_SPLIT}"
        if not line:
            line, source = self.split, "c.VGPUMagics.split"
            if isinstance(line, numbers.Integral) and not isinstance(line, bool):
                line = str(int(line))
            elif not isinstance(line, str | None):
                hint = f"give a %vgpu_split line as a string, e.g. {source} = '4'"
                _warn(f"{source} = {excerpt(line)} was not applied: {hint}")
                line = None
            line = (line or "").strip()
        for fw in frameworks.imported():
            state = self.watcher.state(fw, check_cuda=False)
            if self.warn_on_load and state.started:
                what, started_by = runtime_started_lines(fw.label, state.culprit, state.runtime_word)
                todo = remedy(fw.label, "%load_ext vgpu_magic")
                _warn(" ".join([what, as_sentence(started_by), as_sentence(todo)]))
        if not line:
            return
        try:
            request, args = parse_split_line(line)
            result = execute(request, self.watcher, dry_run=args.dry_run)
        except USER_ERRORS as exc:
            _warn(f"{source} = {excerpt(line)} was not applied: {exc}")
            return
        print(f"vgpu_magic: applying {source} = {excerpt(line)}")
        print_summary(result, quiet=args.quiet)
