"""``%vgpu_monitor`` in the real in-process shell: every mistake is one plain
sentence that quotes the bad token, numbers have one grammar, and a refused
line changes nothing. Switching monitoring on (which imports Keras) is tested
in a fresh interpreter in ``test_monitor_keras.py``."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from vgpu_magic.monitor import auto
from vgpu_magic.monitor.magics import parse_monitor_line


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("maybe", "'maybe' is not an action; use on, off or status"),
        ("on --display sometimes", "--display 'sometimes' is not a display mode; use auto, rich, text, none"),
        ("on --dispaly text", "unknown option '--dispaly'; did you mean --display?"),
        ("on --colour red", "unknown option '--colour'; the options are --display and --interval"),
        ("on --interval", "--interval needs a value, e.g. --interval 0.05"),
        ("on text", "'text' is not understood here; use e.g. %vgpu_monitor on --display text"),
        ("status --display text", "options go with 'on', e.g. %vgpu_monitor on --display text"),
        ("on --interval inf", "--interval 'inf' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval 1e308", "--interval '1e308' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval ５", "--interval '５' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval 1_0", "--interval '1_0' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval -1", "--interval '-1' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval -1s", "--interval '-1s' is not a number of seconds; use e.g. --interval 0.05"),
        ("on --interval 0", "--interval '0' is out of range; use 0.001 to 3600 seconds"),
        ("on --interval 99999", "--interval '99999' is out of range; use 0.001 to 3600 seconds"),
        (
            "x" * 500,
            "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' (500 characters) is not an action; use on, off or status",
        ),
    ],
)
def test_a_mistake_is_one_plain_sentence_and_changes_nothing(ip, line, message):
    before = auto.status()
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("vgpu_monitor", line)
    assert str(info.value) == message
    assert auto.status() == before == "automatic memory monitoring is off"


def test_good_lines_parse_into_an_action_and_options():
    assert parse_monitor_line("") == ("status", {})
    assert parse_monitor_line("off") == ("off", {})
    assert parse_monitor_line("on --display text --interval 0.2") == ("on", {"display": "text", "interval": 0.2})
    assert parse_monitor_line("on --interval=.5 --display=none") == ("on", {"interval": 0.5, "display": "none"})


def test_status_and_off_print_one_line_and_help_shows_the_options(ip, capsys):
    ip.run_line_magic("vgpu_monitor", "status")
    ip.run_line_magic("vgpu_monitor", "off")
    assert capsys.readouterr().out.splitlines() == ["automatic memory monitoring is off"] * 2
    help_text = ip.find_line_magic("vgpu_monitor").__doc__
    assert "%vgpu_monitor on --display text" in help_text and "--interval" in help_text
