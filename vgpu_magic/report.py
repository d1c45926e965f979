"""What ``%vgpu_status`` shows, as data with three renderings: HTML for
notebooks, plain text for terminals, JSON for machines.

Collecting a status never starts TensorFlow's runtime: memory in use is read
only when the runtime already runs.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .inventory import DeviceInventory
from .runtime import RuntimeState

__all__ = ["LogicalDeviceStatus", "StatusReport", "collect_status", "format_bytes"]

_MIB = 1024 * 1024


def format_bytes(n: int | float | None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; ``None`` -> ``'—'``."""
    if n is None:
        return "—"
    if n >= 1024 * _MIB:
        return f"{n / (1024 * _MIB):.2f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


@dataclass(frozen=True)
class LogicalDeviceStatus:
    """One logical device: its name, the physical device it lives on, its cap
    (MiB, ``None`` = uncapped), and current/peak bytes when the runtime runs."""

    name: str
    physical: str
    cap_mib: int | None
    current: int | None = None
    peak: int | None = None


@dataclass
class StatusReport:
    """Everything ``%vgpu_status`` knows."""

    inventory: DeviceInventory
    runtime: RuntimeState
    logical: list[LogicalDeviceStatus]
    replicas: int
    visible_gpus: tuple[int, ...]
    host_memory: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensorflow": self.inventory.tf_version,
            "runtime": {
                "tf_imported": self.runtime.tf_imported,
                "started": self.runtime.started,
                "started_by": self.runtime.culprit or None,
                "cuda_context_holders": list(self.runtime.cuda_holders),
            },
            "physical": {
                "cpus": self.inventory.cpus,
                "gpus": [dict(asdict(g), name=g.name, visible=g.index in self.visible_gpus) for g in self.inventory.gpus],
            },
            "logical": [asdict(d) for d in self.logical],
            "host_memory_shared": self.host_memory,
            "replicas": self.replicas,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for d in self.logical:
            cap = f"{d.cap_mib} MiB" if d.cap_mib is not None else ("none" if d.name.find("CPU") >= 0 else "whole GPU")
            if d.name.find("CPU") >= 0 and self.host_memory is not None:
                cur, peak = "shared", "shared"
            else:
                cur, peak = format_bytes(d.current), format_bytes(d.peak)
            rows.append((d.name, d.physical, cap, cur, peak))
        return rows

    def _gpu_lines(self) -> list[str]:
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

    def _host_line(self) -> str | None:
        if self.host_memory is None:
            return None
        n = sum(1 for d in self.logical if "CPU" in d.name)
        return (
            f"host memory (one allocator shared by {n} logical CPU{'s' if n != 1 else ''}): "
            f"{format_bytes(self.host_memory['current'])} in use, peak {format_bytes(self.host_memory['peak'])}"
        )

    def __str__(self) -> str:
        out = [f"TensorFlow {self.inventory.tf_version} — runtime {self.runtime.describe()}"]
        out.append("Physical devices:")
        out.append(f"  /physical_device:CPU:0 (host)" if self.inventory.cpus else "  no CPU device")
        out += [f"  {line}" for line in self._gpu_lines()]
        out.append("Logical devices" + ("" if self.runtime.started else " (planned; created when the runtime starts)") + ":")
        header = ("device", "on", "cap", "in use", "peak")
        rows = [header] + self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        host = self._host_line()
        if host:
            out.append(host)
        elif not self.runtime.started:
            out.append("memory in use: shown once the runtime has started (status never starts it)")
        out.append(f"Replicas: MirroredStrategy() would use {self.replicas} device(s)")
        out += [f"Note: {n}" for n in self.notes]
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        esc = html.escape
        state = esc(self.runtime.describe())
        colour = "#b00020" if self.runtime.started else "#1b5e20"
        parts = [
            '<div class="vgpu-status">',
            f"<p><b>TensorFlow {esc(str(self.inventory.tf_version))}</b> — runtime: "
            f'<span style="color:{colour}">{state}</span></p>',
            "<p><b>Physical devices</b></p><ul>",
            "<li>/physical_device:CPU:0 (host)</li>",
        ]
        parts += [f"<li>{esc(line)}</li>" for line in self._gpu_lines()]
        parts.append("</ul>")
        caption = "Logical devices" + ("" if self.runtime.started else " (planned; created when the runtime starts)")
        parts.append(f"<table><caption style='text-align:left'><b>{esc(caption)}</b></caption>")
        parts.append("<tr>" + "".join(f"<th>{h}</th>" for h in ("device", "on", "cap", "in use", "peak")) + "</tr>")
        for r in self._rows():
            parts.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>")
        parts.append("</table>")
        host = self._host_line()
        if host:
            parts.append(f"<p>{esc(host)}</p>")
        elif not self.runtime.started:
            parts.append("<p>Memory in use: shown once the runtime has started (status never starts it).</p>")
        parts.append(f"<p><b>Replicas:</b> MirroredStrategy() would use {self.replicas} device(s)</p>")
        parts += [f"<p>Note: {esc(n)}</p>" for n in self.notes]
        parts.append("</div>")
        return "\n".join(parts)


def collect_status(runtime: RuntimeState, inventory: DeviceInventory | None = None) -> StatusReport:
    """Gather the status. Imports TensorFlow; never starts its runtime."""
    from .inventory import probe_inventory
    from .tfconfig import memory_readings, read_configuration

    inventory = inventory or probe_inventory()
    # The state may have been taken before this call imported TensorFlow.
    runtime = replace(runtime, tf_imported=True)
    snap = read_configuration()
    names = snap.logical_names()
    readings: dict[str, dict[str, int]] = {}
    host = None
    if runtime.started:
        gpu_devices = [d for p in snap.gpu_names if p in names for d in names[p]]
        readings = memory_readings(gpu_devices)
        cpu_first = names.get(snap.cpu_names[0], []) if snap.cpu_names else []
        if cpu_first:
            host = memory_readings(cpu_first[:1]).get(cpu_first[0])
    logical = []
    for physical, devices in names.items():
        caps = snap.logical.get(physical) or (None,) * len(devices)
        for name, cap in zip(devices, caps):
            r = readings.get(name, {})
            logical.append(LogicalDeviceStatus(name, physical, cap, r.get("current"), r.get("peak")))
    notes = list(inventory.notes)
    if snap.cpu_names and len(names.get(snap.cpu_names[0], [])) > 1 and runtime.started:
        notes.append("logical CPUs share one host allocator, so memory is shown once for all of them")
    return StatusReport(
        inventory=inventory,
        runtime=runtime,
        logical=logical,
        replicas=len(snap.replica_devices()),
        visible_gpus=snap.visible_gpus,
        host_memory=host,
        notes=notes,
    )
