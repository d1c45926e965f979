"""The ``%vgpu_monitor`` magic: a thin face over :mod:`vgpu_magic.monitor.auto`.

It parses its line into an action and options, validates all of it (the
options through the same checks as ``MemoryMonitor(...)``), and only then
switches automatic monitoring. A mistake is one plain sentence that quotes
the bad token and says what would work.
"""

from __future__ import annotations

import difflib

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

__all__ = ["MonitorMagics", "parse_monitor_line"]

ACTIONS = ("on", "off", "status")
_OPTIONS = ("--display", "--interval")


def _seconds(text: str) -> float:
    """``--interval``'s value through the one number grammar of every option."""
    from ..grammar import parse_seconds
    from ..planner import PlanError
    from .recorder import MAX_INTERVAL, MIN_INTERVAL

    try:
        return parse_seconds(text, minimum=MIN_INTERVAL, maximum=MAX_INTERVAL, option="--interval")
    except PlanError as exc:
        raise UsageError(str(exc)) from None


def parse_monitor_line(line: str) -> tuple[str, dict[str, object]]:
    """``"on --display text"`` -> ``("on", {"display": "text"})``.

    Raises :class:`~IPython.core.error.UsageError` with one sentence for
    anything else; changes nothing.
    """
    from ..planner import excerpt
    from .display import DISPLAY_MODES

    words = line.split()
    action = "status"
    if words and not words[0].startswith("-"):
        action = words.pop(0)
        if action not in ACTIONS:
            raise UsageError(f"{excerpt(action)} is not an action; use on, off or status")
    options: dict[str, object] = {}
    while words:
        word = words.pop(0)
        name, has_value, value = word.partition("=")
        if name not in _OPTIONS:
            if not name.startswith("-"):
                raise UsageError(f"{excerpt(word)} is not understood here; use e.g. %vgpu_monitor on --display text")
            close = difflib.get_close_matches(name, _OPTIONS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "the options are --display and --interval"
            raise UsageError(f"unknown option {excerpt(name)}; {hint}")
        if not has_value:
            if not words or words[0].startswith("--"):
                example = "--display text" if name == "--display" else "--interval 0.05"
                raise UsageError(f"{name} needs a value, e.g. {example}")
            value = words.pop(0)
        if name == "--display":
            if value not in DISPLAY_MODES:
                raise UsageError(f"--display {excerpt(value)} is not a display mode; use {', '.join(DISPLAY_MODES)}")
            options["display"] = value
        else:
            options["interval"] = _seconds(value)
    if options and action != "on":
        raise UsageError("options go with 'on', e.g. %vgpu_monitor on --display text")
    return action, options


@magics_class
class MonitorMagics(Magics):
    """``%vgpu_monitor on|off|status``."""

    def on_unload(self) -> None:
        """``%unload_ext vgpu_magic``: switch automatic monitoring off."""
        from . import auto

        auto.disable()

    @magic_arguments()
    @argument("action", nargs="?", default="status", help="on, off or status (default: status)")
    @argument(
        "--display",
        default=None,
        help="how each monitor shows memory: auto (a live plot in a notebook, text elsewhere), rich, text or none",
    )
    @argument("--interval", default=None, help="seconds between samples, 0.001 to 3600 (default 0.05)")
    @line_magic
    def vgpu_monitor(self, line: str = "") -> None:
        """Monitor the memory of every logical device in every Keras
        ``fit``/``evaluate``/``predict``, without changing the code.

        Examples
        --------
        ::

          In [1]: %vgpu_monitor on                  # a live plot under every later fit
          In [2]: %vgpu_monitor on --display text   # one line per epoch instead
          In [3]: %vgpu_monitor status
          In [4]: %vgpu_monitor off                 # keras.Model as before

        ``off`` undoes only what is still its own: a later patch of
        ``keras.Model.fit`` by another tool stays. ``%unload_ext vgpu_magic``
        turns it off too. For one call, pass
        ``callbacks=[vgpu_magic.MemoryMonitor()]`` instead.
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
                if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "keras":
                    message = "Keras is not installed in this kernel; pip install keras to monitor fit"
                    raise UsageError(message) from None
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise UsageError(f"Keras failed to import: {reason}") from None
        print(auto.status())
