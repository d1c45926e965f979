"""What ``%vgpu_status`` shows, as data rendered as HTML (in the front end's colours), text or JSON. Collecting
it never starts a runtime: memory in use is read only where the runtime already runs."""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from . import frameworks
from .devices import DeviceInventory
from .runtime import RuntimeState, runtime_state
from .units import MIB, format_bytes


@dataclass(frozen=True)
class LogicalDeviceStatus:
    """One logical device: its cap in MiB (``None``: uncapped), current/peak bytes when the runtime runs."""

    name: str
    physical: str
    cap_mib: int | None
    current: int | None = None
    peak: int | None = None


@dataclass
class FrameworkStatus:
    """Everything ``%vgpu_status`` knows about one framework."""

    inventory: DeviceInventory
    runtime: RuntimeState
    logical: list[LogicalDeviceStatus]
    replicas: int
    visible_gpus: tuple[int, ...]
    host_memory: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.inventory.capabilities.label

    @property
    def words(self):
        """The framework's own words (:class:`~vgpu_magic.devices.Capabilities`)."""
        return self.inventory.capabilities

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.inventory.framework,
            "version": self.inventory.version,
            "runtime": {
                "imported": self.runtime.imported,
                "started": self.runtime.started,
                "started_by": self.runtime.culprit or None,
                "cuda_context_holders": list(self.runtime.cuda_holders),
            },
            "physical": {
                "cpus": self.inventory.cpus,
                "gpus": [
                    dict(asdict(g), name=g.name, visible=g.index in self.visible_gpus) for g in self.inventory.gpus
                ],
            },
            "logical": [asdict(d) for d in self.logical],
            "host_memory_shared": self.host_memory,
            "replicas": self.replicas,
            "replicas_by": self.words.replicas_by,
            "notes": list(self.notes),
        }

    def headline(self) -> str:
        return f"{self.label} {self.inventory.version or ''}".rstrip() + f" — {self.state()}"

    def state(self) -> str:
        return f"{self.words.runtime_word} {self.runtime.describe()}"

    def devices_caption(self) -> str:
        """``"Logical devices"`` (JAX: ``"Devices"``), planned until the runtime starts."""
        caption = "Logical devices" if "logical" in self.words.device_noun else "Devices"
        if not self.runtime.started:
            caption += f" (planned; created when the {self.words.runtime_word} starts)"
        return caption

    def gpu_lines(self) -> list[str]:
        lines = []
        for g in self.inventory.gpus:
            desc = g.model or "GPU (no NVML details)"
            if g.total_mib is not None:
                desc += f", {g.free_mib} / {g.total_mib} MiB free"
            if g.compute_capability:
                desc += f", compute capability {g.compute_capability[0]}.{g.compute_capability[1]}"
            if g.index not in self.visible_gpus:
                desc += " (hidden)"
            lines.append(f"{g.name}: {desc}")
        return lines

    def gpu_rows(self) -> list[tuple[str, str, str, str, str]]:
        """(device, on, cap, in use, peak) for logical GPUs; use as a share of the cap."""
        rows = []
        for d in self.logical:
            if "CPU" in d.physical:
                continue
            cap = f"{d.cap_mib} MiB" if d.cap_mib is not None else "whole GPU"
            cur, peak = format_bytes(d.current), format_bytes(d.peak)
            if d.cap_mib and d.current is not None:
                cur += f" ({100 * d.current / (d.cap_mib * MIB):.0f}% of cap)"
            rows.append((d.name, d.physical, cap, cur, peak))
        return rows

    def cpu_devices(self) -> list[str]:
        return [d.name for d in self.logical if "CPU" in d.physical]

    def cpu_line(self) -> str:
        cpus = self.cpu_devices()
        n = len(cpus)
        text = f"{n} {self.words.device_noun.format(kind='CPU')}{'s' if n != 1 else ''}: {', '.join(cpus)}"
        if n > 1:
            text += " (no memory caps; they share the host's memory)"
        return text

    def memory_line(self) -> str | None:
        if self.host_memory is not None:
            n = len(self.cpu_devices())
            share = f"one allocator shared by {n} logical CPUs" if n > 1 else "the host allocator"
            current, peak = self.host_memory["current"], self.host_memory["peak"]
            text = f"host memory ({share}): {format_bytes(current)} in use, peak {format_bytes(peak)}"
            if not current and not peak:
                text += (
                    " — nothing allocated through it yet (small tensors live in the host process's memory, "
                    "which the live memory plot also shows)"
                )
            return text
        if not self.runtime.started:
            return f"memory in use: shown once the {self.words.runtime_word} has started (status never starts it)"
        return None

    def cpu_memory_rows(self) -> list[tuple[str, str, str]]:
        """(device, in use, peak) of each CPU device that holds its own memory (JAX's)."""
        held = [d for d in self.logical if "CPU" in d.physical and d.current is not None]
        return [(d.name, format_bytes(d.current), format_bytes(d.peak)) for d in held]

    def replicas_line(self) -> str:
        n = self.replicas
        heading = "Replicas" if self.words.replica_noun == "replica" else "Devices"
        text = f"{heading}: {self.words.replicas_by} would use {n} device{'s' if n != 1 else ''}"
        if not self.words.splits_in_process:
            text += f"; more devices are more ranks: %vgpu_cluster start 2 --framework {self.words.name}"
        return text


_HEADER = ("device", "on", "cap", "in use", "peak")
_MEMORY_HEADER = ("device", "in use", "peak")
_MEMORY_CAPTION = "Memory held on each device"


def _aligned(rows: list[tuple[str, ...]], right_from: int) -> list[str]:
    """Rows as aligned text columns: names left, figures (from column ``right_from``) right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]], names: int) -> str:
    """A table, its first ``names`` columns left-aligned (JupyterLab right-aligns every cell: right for figures)."""
    align = ['<{} style="text-align:left">'] * names + ["<{}>"] * (len(header) - names)
    heads = "".join(a.format("th") + f"{html.escape(h)}</th>" for a, h in zip(align, header))
    body = [
        "<tr>" + "".join(a.format("td") + f"{html.escape(c)}</td>" for a, c in zip(align, r)) + "</tr>" for r in rows
    ]
    return "\n".join(["<table>", f"<tr>{heads}</tr>", *body, "</table>"])


def code_spans(text: str) -> str:
    """``text`` escaped for HTML, its `back-quoted` parts (a culprit cell's code) as ``<code>`` (themed)."""
    return re.sub(r"`([^`\n]+)`", r"<code>\1</code>", html.escape(text))


@dataclass
class StatusReport:
    """What ``%vgpu_status`` shows: one :class:`FrameworkStatus` per framework."""

    sections: list[FrameworkStatus]

    def section(self, framework: str) -> FrameworkStatus:
        for s in self.sections:
            if s.inventory.framework == framework:
                return s
        raise KeyError(framework)

    def to_dict(self) -> dict[str, Any]:
        return {"frameworks": [s.to_dict() for s in self.sections]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        out: list[str] = []
        for s in self.sections:
            if out:
                out.append("")
            out += [
                s.headline(),
                "Physical devices:",
                f"  {s.words.host_name}" if s.inventory.cpus else "  no CPU device",
            ]
            out += [f"  {line}" for line in s.gpu_lines()]
            out.append(f"{s.devices_caption()}:")
            if s.cpu_devices():
                out.append(f"  {s.cpu_line()}")
            if rows := s.gpu_rows():
                out += [f"  {line}" for line in _aligned([_HEADER, *rows], right_from=5)]
            if memory := s.memory_line():
                out.append(memory)
            if held := s.cpu_memory_rows():
                out.append(f"{_MEMORY_CAPTION}:")
                out += [f"  {line}" for line in _aligned([_MEMORY_HEADER, *held], right_from=1)]
            out.append(s.replicas_line())
            out += [f"Note: {n}" for n in s.notes]
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        esc = html.escape
        parts = ['<div class="vgpu-status">']
        for s in self.sections:
            state = code_spans(s.state())
            # The front end's text colour (readable on every theme); only a CUDA context held elsewhere is flagged.
            flag = "⚠ " if s.runtime.cuda_holders else ""
            label = f"{s.label} {s.inventory.version or ''}".rstrip()
            parts.append(f"<p><b>{esc(label)}</b> — <span class='vgpu-state'>{flag}{state}</span></p>")
            parts.append(f"<p><b>Physical devices</b></p><ul>\n<li>{esc(s.words.host_name)}</li>")
            parts += [f"<li>{esc(line)}</li>" for line in s.gpu_lines()]
            parts += ["</ul>", f"<p><b>{esc(s.devices_caption())}</b></p>"]
            if s.cpu_devices():
                parts.append(f"<p>{esc(s.cpu_line())}</p>")
            if rows := s.gpu_rows():
                parts.append(_html_table(_HEADER, rows, names=2))
            if memory := s.memory_line():
                parts.append(f"<p>{esc(memory[0].upper() + memory[1:])}</p>")
            if held := s.cpu_memory_rows():
                parts.append(f"<p><b>{_MEMORY_CAPTION}</b></p>")
                parts.append(_html_table(_MEMORY_HEADER, held, names=1))
            heading, _, text = s.replicas_line().partition(": ")
            parts.append(f"<p><b>{esc(heading)}:</b> {esc(text)}</p>")
            parts += [f"<p>Note: {code_spans(n)}</p>" for n in s.notes]
        parts.append("</div>")
        return "\n".join(parts)


def collect_framework(fw, watcher=None) -> FrameworkStatus:
    """One framework's section. Imports it; never starts its runtime."""
    inventory = fw.probe_inventory()
    runtime = runtime_state(watcher, fw, check_cuda=bool(inventory.gpus))
    snap = inventory.current or fw.read_configuration()
    names = snap.logical_names()
    readings: dict[str, dict[str, int]] = {}
    host = None
    if runtime.started:
        gpu_devices = [d for p in snap.gpu_names if p in names for d in names[p]]
        readings = fw.memory_readings(gpu_devices)
        cpu_first = names.get(snap.cpu_names[0], []) if snap.cpu_names else []
        if cpu_first and fw.capabilities.cpus_share_allocator:
            host = fw.memory_readings(cpu_first[:1]).get(cpu_first[0])
        elif cpu_first:
            readings.update(fw.memory_readings(cpu_first))
    logical = []
    for physical, devices in names.items():
        caps = snap.logical.get(physical) or (None,) * len(devices)
        for name, cap in zip(devices, caps):
            r = readings.get(name, {})
            logical.append(LogicalDeviceStatus(name, physical, cap, r.get("current"), r.get("peak")))
    words = fw.capabilities
    replicas = len(snap.replica_devices(words.replicas_on_split_cpu)) if words.splits_in_process else 1
    return FrameworkStatus(inventory, runtime, logical, replicas, snap.visible_gpus, host, list(inventory.notes))


def collect_status(watcher=None, framework: str | None = None) -> StatusReport:
    """Every imported framework's section (``framework``'s, or the selected one if none); never starts a runtime."""
    imported = frameworks.imported() or frameworks.imported(every=True)
    chosen = [frameworks.get(framework)] if framework is not None else imported or [frameworks.select()]
    return StatusReport([collect_framework(fw, watcher) for fw in chosen])
