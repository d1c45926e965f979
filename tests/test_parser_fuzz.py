"""Malformed ``%vgpu_split`` lines, and a property-based fuzz of parser and planner.

The table runs through the real magic in the real in-process IPython shell.
Every line in it is invalid, so nothing is ever configured in the test process;
the tests check that, by comparing TensorFlow's device configuration before and
after each call. The fuzz needs no TensorFlow: it drives
:func:`parse_split_line` and :func:`plan_split` with CPU-only and GPU-shaped
inventories.
"""

from __future__ import annotations

import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import vgpu_magic.api
from support import tf_device_configuration
from vgpu_magic.api import make_request
from vgpu_magic.frameworks.tensorflow import CAPABILITIES as TENSORFLOW
from vgpu_magic.frameworks.tensorflow import system_reserve_mib
from vgpu_magic.grammar import parse_memory, parse_seconds, parse_split_line
from vgpu_magic.inventory import DeviceInventory, GPUInfo
from vgpu_magic.planner import (
    MAX_DEVICES,
    MAX_MEMORY_MIB,
    MIN_MEMORY_MIB,
    PlanError,
    plan_split,
)

# (line, a fragment the one-line message must contain: the bad token or option)
MALFORMED = [
    ("0", "device count 0"),
    ("-2", "device count -2"),
    ("  -0 ", "-0"),
    ("65", "65"),
    ("1000000", "1000000"),
    ("99999999999999999999999", "'99999999999999999999999'"),
    ("four", "'four'"),
    ("4x", "'4x'"),
    ("nan", "'nan'"),
    ("$(rm)", "'$(rm)'"),
    ("2.5", "'2.5'"),
    ("1e3", "'1e3'"),
    ("0x4", "'0x4'"),
    ("1_0", "'1_0'"),
    ("+3", "'+3'"),
    ("\u0663", "'\u0663'"),  # ARABIC-INDIC DIGIT THREE: int() takes it, the parser must not
    ("2 --memory 1024,2048,512", "--memory"),
    ("4 --memory 2048", "--memory"),
    ("--memory 10", "--memory"),
    ("2 --cpu --memory 100", "--memory"),
    ("2 --gpu 3", "GPU 3"),
    ("2 --gpu=1", "GPU 1"),
    ("2 --gpu x", "'x'"),
    ("2 --gpu -1", "--gpu -1"),
    ("2 --bogus", "--bogus"),
    ("2 --mem 100", "--mem"),
    ("2 -x", "-x"),
    ("2 --memory 1" + "0" * 30, "absurdly large"),
    ("2 --memory 1024,,2048", "'1024,,2048'"),
    ("2 --memory ,", "','"),
    ("2 --memory 10XB", "'10XB'"),
    ("2 --memory 1TiBB", "'1TiBB'"),
    ("2 --memory 1.3G", "'1.3G'"),
    ("2 --memory 1.5", "'1.5'"),
    ("2 --memory -5", "--memory -5"),
    ("4 --memory", "--memory"),
    ("2 --growth", "--growth"),
    ("--growth", "--growth"),
    ("2 --cpu --gpu 0", "--cpu and --gpu"),
    ("2 --others maybe", "'maybe'"),
    ("2 --others", "--others"),
    ("2 --visible a", "'a'"),
    ("2 --visible 0,,1", "'0,,1'"),
    ("2 --visible 5", "GPU 5"),
    ("2 --visible -1", "--visible -1"),
    ("2 'unbalanced", "'unbalanced"),
    ('2 "x', '"x'),
    ("4 extra words", "extra words"),
    ("2 'a\nb'", "a\\nb"),
]


@pytest.mark.usefixtures("cpu_inventory")
@pytest.mark.parametrize("line, fragment", MALFORMED, ids=[repr(line) for line, _ in MALFORMED])
def test_malformed_line_is_one_line_usage_error_and_configures_nothing(ip, line, fragment):
    from vgpu_magic.frameworks import get as _framework

    tf_runtime_started = _framework("tensorflow").runtime_started

    before = tf_device_configuration()
    started_before = tf_runtime_started()
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("vgpu_split", line)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert fragment in message
    assert tf_device_configuration() == before
    assert tf_runtime_started() == started_before


@pytest.mark.usefixtures("cpu_inventory")
def test_malformed_line_in_a_cell_shows_no_traceback(ip, capsys):
    result = ip.run_cell("%vgpu_split four", store_history=False)
    captured = capsys.readouterr()
    assert isinstance(result.error_in_exec, UsageError)
    assert "UsageError: 'four' is not a device count" in captured.err
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.usefixtures("cpu_inventory")
def test_status_rejects_unknown_options(ip):
    with pytest.raises(UsageError, match="unknown option '--verbose'; %vgpu_status takes --json"):
        ip.run_line_magic("vgpu_status", "--verbose")


# -- property-based fuzz ---------------------------------------------------------------

COUNT_WORDS = ["0", "1", "2", "3", "4", "8", "64", "65", "-1", "-0", "2.5", "x", "1_0", "+3", "\u0663", "\u00b2"]
OPTION_WORDS = [
    "--memory",
    "-m",
    "--gpu",
    "--cpu",
    "--others",
    "--visible",
    "--growth",
    "--dry-run",
    "-n",
    "-r",
    "-q",
    "--return",
    "--quiet",
    "--bogus",
    "--",
    "-",
    "--memory=",
    "--gpu=1",
    "-m1024",
    "-nq",
    "--help",
    "-h",
]
VALUE_WORDS = [
    "64",
    "63",
    "1024",
    "2048",
    "2GB",
    "1.5G",
    "1.3G",
    "10XB",
    "1024,2048",
    "1024,,2048",
    ",",
    "hide",
    "keep",
    "none",
    "0",
    "1",
    "3",
    "0,1",
    "0,0",
    "1,3",
    "99999999999999",
    "1" + "0" * 50,
    "-5",
    "0.5",
    "1T",
]
tokens = st.lists(
    st.one_of(
        st.sampled_from(COUNT_WORDS),
        st.sampled_from(OPTION_WORDS),
        st.sampled_from(VALUE_WORDS),
        st.text(max_size=12),
    ),
    max_size=8,
)

CAPABILITIES = [(6, 1), (7, 5), (8, 0), (8, 6), (9, 0), None]
gpu_infos = st.builds(
    lambda free, cc: (free, cc),
    st.one_of(st.none(), st.sampled_from([0, 200, 1500, 2047, 2048, 8000, 24000, 80000]), st.integers(0, 200_000)),
    st.sampled_from(CAPABILITIES),
)


def _inventory(specs) -> DeviceInventory:
    gpus = tuple(
        GPUInfo(index=i, model="fuzz GPU", total_mib=free, free_mib=free, compute_capability=cc)
        for i, (free, cc) in enumerate(specs)
    )
    return DeviceInventory(gpus=gpus, cpus=1, version="2.21.0", nvml_available=True, capabilities=TENSORFLOW)


inventories = st.one_of(
    st.just(DeviceInventory(capabilities=TENSORFLOW)),
    st.lists(gpu_infos, min_size=1, max_size=4).map(_inventory),
)


def assert_one_line(error: PlanError) -> None:
    message = str(error)
    assert message.strip(), "empty error message"
    assert len(message.splitlines()) == 1, message


def check_plan(plan, request, inventory: DeviceInventory) -> None:
    """The invariants every plan the planner returns must hold."""
    indices = [g.index for g in inventory.gpus]
    if plan.visible_gpus is not None:
        assert set(plan.visible_gpus) <= set(indices)
        assert len(set(plan.visible_gpus)) == len(plan.visible_gpus)
    if not plan.splits:
        assert plan.physical_index is None
        assert plan.memory_growth or plan.visible_gpus is not None
        if plan.memory_growth:
            assert inventory.gpus
        return
    assert not plan.memory_growth
    assert 1 <= plan.count <= MAX_DEVICES
    assert len(plan.memory_limits) == plan.count
    if request.count is not None:
        assert plan.count == request.count
    if plan.device_type == "CPU":
        assert plan.memory_limits == (None,) * plan.count
        assert request.memory is None
        assert not inventory.gpus or request.target == "cpu"
        return
    assert plan.device_type == "GPU"
    assert request.target != "cpu"
    assert plan.physical_index in indices
    assert all(isinstance(m, int) and MIN_MEMORY_MIB <= m <= MAX_MEMORY_MIB for m in plan.memory_limits)
    if plan.visible_gpus is not None:
        assert plan.physical_index in plan.visible_gpus
    gpu = inventory.gpus[indices.index(plan.physical_index)]
    if gpu.free_mib is None:
        assert plan.usable_mib is None
    else:
        usable = gpu.free_mib - system_reserve_mib(gpu.free_mib, gpu.compute_capability)
        assert plan.usable_mib == usable
        assert sum(plan.memory_limits) <= usable
        if request.memory is None:  # even split: nothing left on the table beyond rounding
            assert usable - sum(plan.memory_limits) < plan.count


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=tokens, inventory=inventories, quoted=st.booleans())
def test_fuzz_line_gives_valid_plan_or_one_line_plan_error(words, inventory, quoted):
    line = shlex.join(words) if quoted else " ".join(words)
    try:
        request, _ = parse_split_line(line)
        plan = plan_split(request, inventory)
    except PlanError as exc:
        assert_one_line(exc)
        return
    check_plan(plan, request, inventory)
    echoed = plan.magic_line().removeprefix("%vgpu_split")
    again_request, _ = parse_split_line(echoed)
    assert plan_split(again_request, inventory) == plan


python_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 100),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["2GB", "1024", "1.5G", "x", "1024,2048", ""]),
    st.lists(st.one_of(st.integers(-10, 5000), st.text(max_size=6), st.booleans(), st.none()), max_size=5),
)


@settings(max_examples=500, deadline=None)
@given(
    count=python_values,
    memory=python_values,
    cpu=st.booleans(),
    gpu=st.one_of(st.none(), st.integers(-2, 5), st.text(max_size=3), st.booleans()),
    others=st.sampled_from(["hide", "keep", "maybe", ""]),
    visible=st.one_of(st.none(), st.lists(st.integers(-1, 5), max_size=4), st.text(max_size=3), st.just([True])),
    growth=st.booleans(),
    inventory=inventories,
)
def test_fuzz_python_api_request(count, memory, cpu, gpu, others, visible, growth, inventory):
    try:
        request = make_request(count, memory, cpu=cpu, gpu=gpu, others=others, visible=visible, growth=growth)
        plan = plan_split(request, inventory)
    except PlanError as exc:
        assert_one_line(exc)
        return
    check_plan(plan, request, inventory)


@settings(max_examples=500, deadline=None)
@given(text=st.one_of(st.text(max_size=30), st.from_regex(r"\s*[0-9]{1,60}(\.[0-9]{0,60})?\s*[A-Za-z]{0,4}\s*")))
def test_fuzz_parse_memory(text):
    try:
        mib = parse_memory(text)
    except PlanError as exc:
        assert_one_line(exc)
        return
    assert isinstance(mib, int) and mib >= 0


def test_memory_lists_get_one_message_from_the_api_and_the_magic():
    with pytest.raises(PlanError) as api_error:
        vgpu_magic.api.make_request(2, memory="1024,,2048")
    with pytest.raises(PlanError) as magic_error:
        parse_split_line("2 --memory 1024,,2048")
    assert str(api_error.value) == str(magic_error.value)
    assert "has an empty item" in str(api_error.value)


def test_one_number_grammar_for_seconds():
    assert parse_seconds("0.05") == 0.05
    for text in ("inf", "1e308", "５", "1_0", "-1", "0", "nan", ""):
        with pytest.raises(PlanError):
            parse_seconds(text)
