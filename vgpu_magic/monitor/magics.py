"""The ``%vgpu_monitor`` magic: a thin face over :mod:`vgpu_magic.monitor.auto` that validates its whole line (the
options through ``MemoryMonitor(...)``'s checks) before it switches anything."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import USER_ERRORS, FrameworkImportError
from ..grammar import choice, parse_arguments, seconds, with_example
from .display import DISPLAY_MODES

__all__ = ["MonitorMagics", "parse_monitor_line"]

ACTIONS = ("on", "off", "status")


@with_example("--interval 0.05")
def _interval(text: str) -> float:
    """``--interval``'s value, within the bounds ``MemoryMonitor(interval=...)`` accepts."""
    from .session import MAX_INTERVAL, MIN_INTERVAL

    return seconds("--interval", MIN_INTERVAL, MAX_INTERVAL)(text)


def parse_monitor_line(line: str) -> tuple[str, dict[str, object]]:
    """``"on --display text"`` -> ``("on", {"display": "text"})``; a one-sentence ``UsageError`` for anything else."""
    try:
        args = parse_arguments(
            MonitorMagics.vgpu_monitor.parser,
            line,
            example="%vgpu_monitor on --display text",
            options_hint="the options are --display and --interval",
        )
    except USER_ERRORS as exc:
        raise UsageError(str(exc)) from None
    options = {name: value for name, value in vars(args).items() if name != "action" and value is not None}
    if options and args.action != "on":
        raise UsageError("options go with 'on', e.g. %vgpu_monitor on --display text")
    return args.action, options


@magics_class
class MonitorMagics(Magics):
    """``%vgpu_monitor on|off|status``."""

    def on_unload(self) -> None:
        """``%unload_ext vgpu_magic``: switch automatic monitoring off."""
        from . import auto

        auto.disable()

    @line_magic
    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        default="status",
        type=choice(ACTIONS, "{value} is not an action; use on, off or status", "%vgpu_monitor on"),
        help="on, off or status (default: status)",
    )
    @argument(
        "--display",
        type=choice(
            DISPLAY_MODES, "--display {value} is not a display mode; use " + ", ".join(DISPLAY_MODES), "--display text"
        ),
        metavar="MODE",
        help="how each monitor shows memory: auto (a live plot in a notebook, text elsewhere), rich, text or none",
    )
    @argument(
        "--interval", type=_interval, metavar="SECONDS", help="seconds between samples, 0.001 to 3600 (default 0.05)"
    )
    def vgpu_monitor(self, line: str = "") -> None:
        """
        Monitor the memory of every logical device in every Keras ``fit``/``evaluate``/``predict``, unchanged.

        Examples
        --------
        ::

          In [1]: %vgpu_monitor on                  # a live plot under every later fit
          In [2]: %vgpu_monitor on --display text   # one line per epoch instead
          In [3]: %vgpu_monitor status
          In [4]: %vgpu_monitor off                 # keras.Model as before

        ``off`` undoes only what is still its own: a later patch of ``keras.Model.fit`` by another tool stays.
        ``%unload_ext vgpu_magic`` turns it off too. For one call, pass ``callbacks=[vgpu_magic.MemoryMonitor()]``.
        """
        from . import auto

        action, options = parse_monitor_line(line)
        if action == "off":
            auto.disable()
        elif action == "on":
            try:
                auto.enable(**options)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            except ImportError as exc:
                failure = FrameworkImportError.of("Keras", "keras", "pip install keras to monitor fit", exc)
                raise UsageError(str(failure)) from None
        print(auto.status())
