"""The planner and the configuration it asks for, on GPU-shaped data.

No TensorFlow and no GPU are needed: inventories are built from
:class:`GPUInfo` records shaped like what NVML reports for real cards, and the
planner and :func:`vgpu_magic.planner.configuration_after` are the real code that runs on a
GPU machine. Expected numbers come from the tables below, not from the code
under test.
"""

from __future__ import annotations

import pytest

import vgpu_magic.api
from support import two_gpu_snapshot, two_gpus
from vgpu_magic.frameworks.base import ConfigSnapshot
from vgpu_magic.frameworks.tensorflow import CAPABILITIES as TENSORFLOW
from vgpu_magic.frameworks.tensorflow import system_reserve_mib
from vgpu_magic.grammar import parse_memory, parse_split_line
from vgpu_magic.inventory import DeviceInventory, GPUInfo
from vgpu_magic.planner import (
    MAX_DEVICES,
    MIN_MEMORY_MIB,
    PlanError,
    SplitPlan,
    SplitRequest,
    configuration_after,
    plan_split,
)

CPU_ONLY = DeviceInventory(gpus=(), cpus=1, version="2.21.0", capabilities=TENSORFLOW)

#: TensorFlow's per-GPU reserve (MinSystemMemory in gpu_device.cc), written out
#: independently of ``system_reserve_mib``: below 2 GiB free 225 MiB, otherwise by
#: compute capability major: <=6 -> 500, 7 -> 1050, 8 -> 1536, newer/unknown -> 1800.
RESERVE_MIB = {
    (6, 1): 500,
    (7, 5): 1050,
    (8, 0): 1536,
    (9, 0): 1800,
    None: 1800,
}
FREE_MIB = (1500, 8000, 24000, 80000)
CAPABILITIES = tuple(RESERVE_MIB)


def gpu_inventory(
    *free_mib: int | None, cc: tuple[int, int] | None = (8, 0), total_mib: int = 81559
) -> DeviceInventory:
    """An inventory of ``len(free_mib)`` GPUs shaped like NVML's report."""
    gpus = tuple(
        GPUInfo(
            index=i,
            model=None if free is None else "NVIDIA Test GPU",
            total_mib=None if free is None else max(total_mib, free),
            free_mib=free,
            compute_capability=None if free is None else cc,
            nvml_index=None if free is None else i,
        )
        for i, free in enumerate(free_mib)
    )
    known = any(f is not None for f in free_mib)
    return DeviceInventory(gpus=gpus, cpus=1, version="2.21.0", nvml_available=known, capabilities=TENSORFLOW)


def expected_usable(free: int, cc) -> int:
    return free - (225 if free < 2048 else RESERVE_MIB[cc])


def plan_line(line: str, inventory: DeviceInventory) -> SplitPlan:
    request, _ = parse_split_line(line)
    return plan_split(request, inventory)


# -- TensorFlow's reserve ----------------------------------------------------


@pytest.mark.parametrize("cc", CAPABILITIES)
@pytest.mark.parametrize("free", (*FREE_MIB, 2047, 2048))
def test_system_reserve_follows_tensorflow_rule(free, cc):
    assert system_reserve_mib(free, cc) == free - expected_usable(free, cc)


# -- even split --------------------------------------------------------------


@pytest.mark.parametrize("cc", CAPABILITIES)
@pytest.mark.parametrize("free", FREE_MIB)
@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_even_split_divides_free_minus_reserve(count, free, cc):
    inventory = gpu_inventory(free, cc=cc)
    usable = expected_usable(free, cc)
    plan = plan_line(str(count), inventory)
    assert plan.device_type == "GPU"
    assert plan.physical_index == 0
    assert plan.memory_limits == (usable // count,) * count
    assert plan.usable_mib == usable
    assert sum(plan.memory_limits) <= usable
    assert plan.visible_gpus is None  # one GPU: visibility is left alone
    assert f"{count} logical GPU" in plan.describe()
    assert f"({usable // count} MiB" in plan.describe()


def test_even_split_refuses_devices_below_minimum():
    inventory = gpu_inventory(1500, cc=(7, 5))  # 1275 MiB usable
    with pytest.raises(PlanError, match=r"1275 MiB usable; 64 devices would get 19 MiB each") as err:
        plan_line("64", inventory)
    assert "use fewer devices" in str(err.value)
    assert plan_line("19", inventory).memory_limits == (67,) * 19
    with pytest.raises(PlanError, match="20 devices would get 63 MiB"):
        plan_line("20", inventory)


def test_free_memory_below_reserve_is_refused():
    with pytest.raises(PlanError, match="has 0 MiB usable"):
        plan_line("1", gpu_inventory(200))


def test_unknown_free_memory_needs_explicit_sizes():
    inventory = gpu_inventory(None)
    with pytest.raises(PlanError, match=r"free memory of GPU 0 is unknown .*--memory 2048"):
        plan_line("2", inventory)
    plan = plan_line("2 --memory 4096", inventory)
    assert plan.memory_limits == (4096, 4096)
    assert plan.usable_mib is None
    assert any("not checked" in note for note in plan.notes)


# -- explicit sizes ------------------------------------------------------------


@pytest.mark.parametrize(
    "line, limits",
    [
        ("2 --memory 2048", (2048, 2048)),
        ("2 -m 2GB", (2048, 2048)),
        ("3 --memory 1024,2048,512", (1024, 2048, 512)),
        ("--memory 1024,2048", (1024, 2048)),  # count taken from the list
        ("--memory 1.5G", (1536,)),  # one capped device, no split
        ("1 --memory 4GiB", (4096,)),
        ("2 --memory=1000MB,1000mib", (1000, 1000)),
        (f"4 --memory {MIN_MEMORY_MIB}", (MIN_MEMORY_MIB,) * 4),
    ],
)
def test_explicit_sizes(line, limits):
    plan = plan_line(line, gpu_inventory(24000, cc=(8, 6)))
    assert plan.memory_limits == limits
    assert plan.count == len(limits)


def test_sum_exactly_fitting_is_accepted_one_more_mib_is_not():
    usable = expected_usable(8000, (8, 0))  # 6464
    inventory = gpu_inventory(8000, cc=(8, 0))
    half = usable // 2
    assert plan_line(f"2 --memory {half}", inventory).memory_limits == (half, half)
    with pytest.raises(PlanError) as err:
        plan_line(f"--memory {half},{half + 1}", inventory)
    message = str(err.value)
    assert f"{usable + 1} MiB requested does not fit GPU 0" in message
    assert f"8000 MiB free minus TensorFlow's 1536 MiB reserve leaves {usable} MiB" in message


@pytest.mark.parametrize("free, cc", [(8000, (6, 1)), (24000, (7, 5)), (80000, (9, 0)), (1500, None)])
def test_sum_too_large(free, cc):
    usable = expected_usable(free, cc)
    each = usable // 2 + 1
    with pytest.raises(PlanError, match=f"{2 * each} MiB requested does not fit GPU 0.*leaves {usable} MiB"):
        plan_line(f"2 --memory {each}", gpu_inventory(free, cc=cc))


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("2 --memory 1024,2048,512", "--memory lists 3 sizes for 2 devices"),
        ("4 --memory 1024,2048", "--memory lists 2 sizes for 4 devices"),
        ("2 --memory 32", "memory 32 MiB is too small"),
        ("2 --memory 0", "memory 0 MiB is too small"),
        ("2 --memory 4096,10", "memory 10 MiB is too small"),
        ("2 --memory 2000000000", "memory 2000000000 MiB is absurdly large"),
        ("2 --memory 5TB", "does not fit GPU 0"),
        ("0", "device count 0 is out of range"),
        (str(MAX_DEVICES + 1), f"device count {MAX_DEVICES + 1} is out of range"),
    ],
)
def test_bad_sizes_and_counts_on_gpu(line, fragment):
    with pytest.raises(PlanError) as err:
        plan_line(line, gpu_inventory(24000))
    assert fragment in str(err.value)
    assert len(str(err.value).splitlines()) == 1


# -- which GPU, and visibility ---------------------------------------------------


@pytest.mark.parametrize("n_gpus", [1, 2, 4])
def test_gpu_index_must_exist(n_gpus):
    inventory = gpu_inventory(*([24000] * n_gpus))
    last = n_gpus - 1
    assert plan_line(f"2 --gpu {last}", inventory).physical_index == last
    with pytest.raises(PlanError) as err:
        plan_line(f"2 --gpu {n_gpus}", inventory)
    have = ", ".join(str(i) for i in range(n_gpus))
    assert str(err.value) == f"GPU {n_gpus} does not exist; this machine has GPU {have} — use --gpu with one of those"


def test_gpu_requested_on_cpu_machine():
    with pytest.raises(PlanError, match="GPU 0 does not exist: TensorFlow sees no GPU here"):
        plan_line("2 --gpu 0", CPU_ONLY)


@pytest.mark.parametrize("n_gpus", [2, 4])
def test_others_hide_makes_the_split_gpu_the_only_visible_one(n_gpus):
    inventory = gpu_inventory(*([24000] * n_gpus))
    plan = plan_line(f"2 --gpu {n_gpus - 1}", inventory)
    assert plan.visible_gpus == (n_gpus - 1,)
    assert any("other GPUs hidden" in note for note in plan.notes)
    assert plan_line("2", inventory).visible_gpus == (0,)


@pytest.mark.parametrize("n_gpus", [2, 4])
def test_others_keep_keeps_every_gpu(n_gpus):
    inventory = gpu_inventory(*([24000] * n_gpus))
    plan = plan_line("2 --others keep --gpu 1", inventory)
    assert plan.visible_gpus == tuple(range(n_gpus))
    assert plan.physical_index == 1


def test_others_is_irrelevant_with_one_gpu():
    inventory = gpu_inventory(24000)
    assert plan_line("2 --others keep", inventory).visible_gpus is None
    assert plan_line("2 --others hide", inventory).visible_gpus is None


def test_visible_interplay_on_four_gpus():
    inventory = gpu_inventory(24000, 24000, 24000, 24000)
    assert plan_line("2 --gpu 2 --visible 2", inventory).visible_gpus == (2,)
    plan = plan_line("2 --visible 0,3 --others keep", inventory)
    assert (plan.physical_index, plan.visible_gpus) == (0, (0, 3))
    with pytest.raises(PlanError, match="--visible keeps several GPUs but --others hide hides them; add --others keep"):
        plan_line("2 --visible 0,3", inventory)
    with pytest.raises(PlanError, match="GPU 1 is split but --visible hides it; add 1 to --visible"):
        plan_line("2 --gpu 1 --visible 0,2 --others keep", inventory)
    with pytest.raises(PlanError, match="--visible '1,1' repeats a GPU"):
        plan_line("2 --gpu 1 --visible 1,1", inventory)
    with pytest.raises(PlanError, match="--visible names GPU 7, which does not exist; GPUs here: 0, 1, 2, 3"):
        plan_line("2 --visible 0,7", inventory)


def test_visibility_only_plans():
    inventory = gpu_inventory(24000, 24000)
    hide_all = plan_line("--visible none", inventory)
    assert (hide_all.splits, hide_all.visible_gpus, hide_all.describe()) == (False, (), "visible GPUs: none")
    only_one = plan_line("--visible 1", inventory)
    assert (only_one.splits, only_one.visible_gpus) == (False, (1,))


# -- memory growth -----------------------------------------------------------------


def test_growth_plans():
    inventory = gpu_inventory(24000, 24000)
    plan = plan_line("--growth", inventory)
    assert (plan.splits, plan.memory_growth, plan.visible_gpus) == (False, True, None)
    assert plan.describe() == "memory growth on"
    plan = plan_line("--growth --visible 1", inventory)
    assert (plan.memory_growth, plan.visible_gpus) == (True, (1,))


@pytest.mark.parametrize("line", ["2 --growth", "--growth --memory 1024", "1 --growth", "--growth --cpu"])
def test_growth_cannot_be_combined_with_a_split(line):
    with pytest.raises(PlanError, match="--growth cannot be combined with a split"):
        plan_line(line, gpu_inventory(24000))


def test_growth_needs_a_gpu():
    with pytest.raises(PlanError, match="--growth needs a GPU"):
        plan_line("--growth", CPU_ONLY)


# -- the CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 4, 8, MAX_DEVICES])
def test_cpu_split_has_no_caps(count):
    plan = plan_line(str(count), CPU_ONLY)
    assert plan.device_type == "CPU"
    assert plan.memory_limits == (None,) * count
    assert "no GPU visible" in plan.notes[0]
    assert "MiB" not in plan.describe()


@pytest.mark.parametrize("line", ["2 --memory 2048", "--memory 1024,1024", "2 --memory 10", "4 -m 1GB"])
def test_memory_caps_refused_on_cpu_whatever_their_size(line):
    with pytest.raises(PlanError, match="memory caps are not supported on CPU devices"):
        plan_line(line, CPU_ONLY)


def test_cpu_forced_on_a_gpu_machine():
    inventory = gpu_inventory(24000)
    plan = plan_line("4 --cpu", inventory)
    assert (plan.device_type, plan.count, plan.cpu_forced) == ("CPU", 4, True)
    assert plan.magic_line() == "%vgpu_split 4 --cpu"
    with pytest.raises(PlanError, match="memory caps are not supported on CPU"):
        plan_line("4 --cpu --memory 1024", inventory)


def test_empty_request_says_what_to_do():
    with pytest.raises(PlanError, match=r"nothing to do; give a device count, e.g. %vgpu_split 4"):
        plan_split(SplitRequest(), gpu_inventory(24000))


@pytest.mark.parametrize(
    "request_, fragment",
    [
        (SplitRequest(count=2, others="maybe"), "--others 'maybe' is not a choice"),
        (SplitRequest(count=2, target="tpu"), "target 'tpu' is not a choice"),
        (SplitRequest(count=2, gpu=-1), "GPU index -1 is negative"),
        (SplitRequest(count=2, memory=()), "memory list is empty"),
    ],
)
def test_requests_built_in_python_are_validated_too(request_, fragment):
    with pytest.raises(PlanError, match=fragment):
        plan_split(request_, gpu_inventory(24000, 24000))


@pytest.mark.parametrize(
    "request_, fragment",
    [
        (SplitRequest(framework="tensorflow"), "nothing to do"),
        (SplitRequest(count=0, framework="tensorflow"), "device count 0 is out of range"),
        (SplitRequest(count=2, others="maybe", framework="tensorflow"), "--others 'maybe' is not a choice"),
    ],
)
def test_a_request_that_no_device_could_satisfy_is_refused_before_the_probe(monkeypatch, request_, fragment):
    """The probe imports the framework (TensorFlow: seconds, which `vgpu-magic plan` with nothing to do waited)."""
    from vgpu_magic import frameworks, outcomes

    def probe():
        raise AssertionError("probed")

    monkeypatch.setattr(frameworks.get("tensorflow"), "probe_inventory", probe)
    with pytest.raises(PlanError, match=fragment):
        outcomes.execute(request_)


# -- memory sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, mib",
    [
        ("2048", 2048),
        ("2048MB", 2048),
        ("2048 mib", 2048),
        ("1.5G", 1536),
        ("2GiB", 2048),
        ("1gb", 1024),
        ("1.25G", 1280),
        ("1T", 1024**2),
        ("64m", 64),
        ("1.0", 1),
    ],
)
def test_parse_memory(text, mib):
    assert parse_memory(text) == mib


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("10XB", "is not a size"),
        ("-5", "is not a size"),
        ("1e3", "is not a size"),
        ("", "is not a size"),
        ("1.3G", "is not a whole number of MiB; round it, e.g. 1331"),
        ("0.5", "is not a whole number of MiB"),
        ("1" + "0" * 400, "is absurdly large"),
        ("1." + "0" * 400, "has too many digits"),
    ],
)
def test_parse_memory_rejects(text, fragment):
    with pytest.raises(PlanError, match=fragment) as err:
        parse_memory(text)
    assert repr(text)[:20] in str(err.value)


# -- the reproducing magic line --------------------------------------------------------

ROUND_TRIP = [
    ("4", CPU_ONLY),
    ("1", CPU_ONLY),
    ("2 --cpu --visible none", gpu_inventory(8000)),
    ("3", gpu_inventory(8000, cc=(7, 5))),
    ("2 --memory 1024,2048", gpu_inventory(24000)),
    ("--memory 2GB", gpu_inventory(24000)),
    ("2 --visible 0", gpu_inventory(24000)),
    ("2 --gpu 1", gpu_inventory(24000, 24000)),
    ("2 --gpu 3 --others keep", gpu_inventory(8000, 8000, 8000, 80000, cc=(9, 0))),
    ("2 --visible 1,3 --gpu 3 --others keep", gpu_inventory(8000, 8000, 8000, 80000)),
    ("8 --memory 512", gpu_inventory(None, None)),
    ("--growth", gpu_inventory(24000)),
    ("--growth --visible 0,1", gpu_inventory(24000, 24000)),
    ("--visible none", gpu_inventory(24000, 24000)),
]


@pytest.mark.parametrize("line, inventory", ROUND_TRIP)
def test_magic_line_round_trips(line, inventory):
    plan = plan_line(line, inventory)
    echoed = plan.magic_line()
    assert echoed.startswith("%vgpu_split")
    again = plan_line(echoed.removeprefix("%vgpu_split"), inventory)
    assert again == plan
    assert again.magic_line() == echoed


def test_magic_line_spells_out_the_even_split():
    plan = plan_line("4", gpu_inventory(24000, cc=(8, 0)))
    # The line a person would write: no sizes pinned to today's free memory (they did not choose them).
    assert plan.memory_limits == ((24000 - 1536) // 4,) * 4
    assert plan.magic_line() == "%vgpu_split 4"
    assert plan_line("4 --memory 5616", gpu_inventory(24000, cc=(8, 0))).magic_line() == "%vgpu_split 4 --memory 5616"


# -- tf.config decision logic on GPU-shaped snapshots ----------------------------------

CPU0 = "/physical_device:CPU:0"


def snapshot(n_gpus: int, logical=None, visible=None, growth=None) -> ConfigSnapshot:
    """What ``read_configuration`` returns on a machine with ``n_gpus`` GPUs."""
    return ConfigSnapshot(
        cpu_names=(CPU0,),
        gpu_names=tuple(f"/physical_device:GPU:{i}" for i in range(n_gpus)),
        logical=dict(logical or {}),
        visible_gpus=tuple(range(n_gpus)) if visible is None else tuple(visible),
        memory_growth=tuple(growth or (False,) * n_gpus),
    )


def test_unconfigured_snapshot_names():
    snap = snapshot(2)
    assert snap.logical_names() == {
        CPU0: ["/device:CPU:0"],
        "/physical_device:GPU:0": ["/device:GPU:0"],
        "/physical_device:GPU:1": ["/device:GPU:1"],
    }
    assert snap.replica_devices() == ["/device:GPU:0", "/device:GPU:1"]
    assert snapshot(0).replica_devices() == ["/device:CPU:0"]


def test_split_with_others_hidden():
    inventory = gpu_inventory(24000, 24000)
    plan = plan_line("2 --memory 1024,2048", inventory)
    new = configuration_after(plan, snapshot(2))
    assert new.logical == {"/physical_device:GPU:0": (1024, 2048)}
    assert new.visible_gpus == (0,)
    assert "/physical_device:GPU:1" not in new.logical_names()
    assert new.replica_devices() == ["/device:GPU:0", "/device:GPU:1"]


def test_split_of_the_second_gpu_renumbers_from_zero():
    plan = plan_line("3 --gpu 1 --memory 1000", gpu_inventory(24000, 24000))
    new = configuration_after(plan, snapshot(2))
    assert new.visible_gpus == (1,)
    assert new.logical_names()["/physical_device:GPU:1"] == ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
    assert new.replica_devices() == ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]


def test_split_with_others_kept_numbers_whole_gpus_after_the_split():
    plan = plan_line("2 --memory 1000 --others keep", gpu_inventory(24000, 24000, 24000))
    new = configuration_after(plan, snapshot(3))
    assert new.logical_names() == {
        CPU0: ["/device:CPU:0"],
        "/physical_device:GPU:0": ["/device:GPU:0", "/device:GPU:1"],
        "/physical_device:GPU:1": ["/device:GPU:2"],
        "/physical_device:GPU:2": ["/device:GPU:3"],
    }
    assert len(new.replica_devices()) == 4


def test_all_gpus_hidden_falls_back_to_the_cpu():
    new = configuration_after(plan_line("--visible none", gpu_inventory(24000, 24000)), snapshot(2))
    assert new.visible_gpus == ()
    assert new.replica_devices() == ["/device:CPU:0"]


def test_cpu_split_on_a_gpu_machine_with_gpus_hidden():
    new = configuration_after(plan_line("3 --cpu --visible none", gpu_inventory(24000)), snapshot(1))
    assert new.logical == {CPU0: (None, None, None)}
    assert new.replica_devices() == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


def test_cpu_split_on_a_gpu_machine_hides_the_gpus():
    # MirroredStrategy() prefers GPUs, so --cpu hides them: the logical CPUs become the replicas.
    plan = plan_line("3 --cpu", gpu_inventory(24000))
    assert plan.visible_gpus == ()
    new = configuration_after(plan, snapshot(1))
    assert new.replica_devices() == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


def test_cpu_split_keeps_gpus_named_in_visible():
    # An explicit --visible wins; MirroredStrategy() then mirrors on the GPU, and the snapshot says so.
    new = configuration_after(plan_line("3 --cpu --visible 0", gpu_inventory(24000)), snapshot(1))
    assert new.replica_devices() == ["/device:GPU:0"]


def test_growth_only_touches_visible_gpus():
    plan = plan_line("--growth --visible 1", gpu_inventory(24000, 24000))
    new = configuration_after(plan, snapshot(2))
    assert new.memory_growth == (False, True)
    assert new.logical == {}


def test_identical_plan_on_configured_snapshot_is_unchanged():
    """What makes a repeated ``%vgpu_split`` a quiet no-op after the runtime started."""
    inventory = gpu_inventory(24000, 24000)
    plan = plan_line("2 --memory 2048", inventory)
    configured = configuration_after(plan, snapshot(2))
    assert configuration_after(plan, configured) == configured
    assert configuration_after(plan_line("3 --memory 2048", inventory), configured) != configured


def test_one_uncapped_cpu_on_an_unconfigured_cpu_is_no_change():
    snap = snapshot(0)
    assert configuration_after(plan_line("1", CPU_ONLY), snap) == snap
    two = configuration_after(plan_line("2", CPU_ONLY), snap)
    assert two != snap
    # Going back to one device is a change once the CPU was split.
    assert configuration_after(plan_line("1", CPU_ONLY), two).logical == {CPU0: (None,)}


# -- TensorFlow's start-time rules and the --cpu/--gpu contradiction, refused by the planner --------


def test_growth_after_a_split_is_refused_by_the_planner():
    # `%vgpu_split 2 --memory 1024` then `%vgpu_split --growth` raised TensorFlow's raw ValueError.
    split = two_gpu_snapshot(logical={"/physical_device:GPU:0": (1024, 1024)}, visible=(0,))
    with pytest.raises(PlanError, match="GPU 0 is already split into 2 logical devices, and TensorFlow refuses"):
        plan_line("--growth", two_gpus(split))


def test_a_split_after_growth_is_refused_by_the_planner():
    grown = two_gpu_snapshot(visible=(0,), growth=(True, False))
    with pytest.raises(PlanError, match="GPU 0 already has memory growth on"):
        plan_line("2 --memory 1024", two_gpus(grown))


def test_growth_that_would_differ_between_visible_gpus_is_refused():
    # `--growth --visible 0` then `--visible 0,1` was accepted, then TensorFlow refused to start.
    first = plan_line("--growth --visible 0", two_gpus(two_gpu_snapshot()))
    assert first.memory_growth and first.visible_gpus == (0,)
    grown = two_gpu_snapshot(visible=(0,), growth=(True, False))
    with pytest.raises(PlanError, match=r"memory growth would be on for GPU 0 but off for GPU 1.*add --growth"):
        plan_line("--visible 0,1", two_gpus(grown))
    assert plan_line("--visible 0,1 --growth", two_gpus(grown)).memory_growth


def test_cpu_and_gpu_contradiction_is_checked_once_in_the_planner():
    inventory = two_gpus()
    for request in (vgpu_magic.api.make_request(2, cpu=True, gpu=0), parse_split_line("2 --cpu --gpu 0")[0]):
        with pytest.raises(PlanError, match="--cpu and --gpu contradict each other"):
            plan_split(request, inventory)
    # GPU 0 named explicitly is no longer confused with the default.
    assert plan_split(vgpu_magic.api.make_request(2, cpu=True), inventory).device_type == "CPU"


# -- what a split simulates (issue 48) -----------------------------------------


SPLIT_SIMULATES = [
    ("4", CPU_ONLY, "simulated: 4 logical CPUs share one allocator and the CPU's cores"),
    ("4 --cpu", gpu_inventory(80000), "simulated: 4 logical CPUs share one allocator and the CPU's cores"),
    ("4", gpu_inventory(80000), "simulated: 4 logical GPUs of one card: no NCCL between them"),
    ("1", CPU_ONLY, ""),
    ("1 --memory 4GB", gpu_inventory(80000), ""),
    ("--visible 0", gpu_inventory(80000, 80000), ""),
    ("--growth", gpu_inventory(80000), ""),
]


@pytest.mark.parametrize(("line", "inventory", "said"), SPLIT_SIMULATES)
def test_a_split_says_once_what_it_simulates_and_nothing_where_nothing_is(line, inventory, said):
    """Issue 48: the plan carries what the split only simulates, and the one summary says it in one line where the
    split is made (or would be); a quiet no-op stays one line, and a refused split configured nothing."""
    from vgpu_magic.outcomes import SplitResult, summary_lines

    plan = plan_line(line, inventory)
    for status in ("applied", "planned"):
        shown, warned = summary_lines(SplitResult(status, plan, TENSORFLOW, devices=["/device:CPU:0"]))
        simulated = [text.strip() for text in shown + warned if "simulated" in text]
        assert simulated == ([said] if said else []), status
    for status, why in (("unchanged", ""), ("blocked", "a cell")):
        shown, warned = summary_lines(SplitResult(status, plan, TENSORFLOW, blocked_reason=why))
        assert not [text for text in shown + warned if "simulated" in text], status


def test_jax_cpu_devices_simulate_in_jaxs_words():
    from vgpu_magic.devices import simulated_line
    from vgpu_magic.frameworks.jax import CAPABILITIES as JAX

    inventory = DeviceInventory(gpus=(), cpus=1, version="0.7.0", capabilities=JAX)
    said = simulated_line(plan_split(SplitRequest(count=8), inventory).simulated)
    # JAX's CPU devices each report their own figures: no shared allocator to speak of.
    assert said == "simulated: 8 CPU devices share the CPU's cores"
