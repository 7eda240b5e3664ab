"""Where the GPU inventory comes from (devices.py holds the snapshot everyone reads): NVML,
the Jetson device tree and sysfs, or nvidia-smi's CSV, each parsed into `GPU` records, and
`probe`, which asks them in that order (see devices.py for what each gives).
"""


from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("outrider.devices")

#: the nvidia-smi query this module parses (field order matters).
NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu",
                     "temperature.gpu", "compute_cap")
NVIDIA_SMI_COMMAND = ("nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}",
                      "--format=csv,noheader,nounits")

#: Jetson SoC (device-tree `compatible` family) -> CUDA compute capability.
_TEGRA_CAPABILITY = {"tegra210": "5.3", "tegra186": "6.2", "tegra194": "7.2", "tegra234": "8.7",
                     "tegra264": "11.0"}
#: the same by module name, for device trees whose `compatible` we cannot read.
_JETSON_CAPABILITY = (("thor", "11.0"), ("orin", "8.7"), ("xavier", "7.2"), ("tx2", "6.2"),
                      ("nano", "5.3"), ("tx1", "5.3"))


@dataclass(frozen=True)
class GPU:
    """One GPU as CUDA numbers it; None where the source does not say."""

    index: int
    name: str
    memory_total_mib: Optional[int] = None
    memory_used_mib: Optional[int] = None
    utilization_percent: Optional[float] = None
    temperature_c: Optional[float] = None
    compute_capability: Optional[str] = None  # "9.0"
    uuid: Optional[str] = None
    #: what is wrong with it (lost, ECC errors), or None when nothing is known to be
    error: Optional[str] = None
    #: Jetson: the "GPU memory" is the system RAM it shares with the CPU
    shared_memory: bool = False

    @property
    def device(self) -> str:
        """The device string placement uses: 'cuda:N'."""
        return f"cuda:{self.index}"

    def label(self) -> str:
        """'NVIDIA H200, 140 GiB' (what `device: auto` says it chose)."""
        if self.memory_total_mib is None:
            return self.name
        shared = " shared" if self.shared_memory else ""
        return f"{self.name}, {self.memory_total_mib / 1024:.0f} GiB{shared}"

    def health(self) -> dict[str, Any]:
        """The per-device entry of server health."""
        return {
            "device": self.device, "name": self.name,
            "memory_used_mib": self.memory_used_mib, "memory_total_mib": self.memory_total_mib,
            "utilization_percent": self.utilization_percent, "temperature_c": self.temperature_c,
            "compute_capability": self.compute_capability, "error": self.error,
            **({"shared_memory": True} if self.shared_memory else {}),
        }


@dataclass(frozen=True)
class Inventory:
    """The GPUs one source found, or none and why each source found none."""

    gpus: tuple[GPU, ...] = ()
    #: "nvml", "jetson", "nvidia-smi", or "none"
    source: str = "none"
    #: why each source before `source` (all of them, for "none") gave nothing
    notes: tuple[str, ...] = ()
    taken_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def count(self) -> int:
        return len(self.gpus)

    def gpu(self, device: str) -> Optional[GPU]:
        """The GPU behind 'cuda' or 'cuda:N', or None."""
        if not device.startswith("cuda"):
            return None
        index = int(device.split(":")[1]) if ":" in device else 0
        return next((g for g in self.gpus if g.index == index), None)

    def why_none(self) -> str:
        """'no GPU found: NVML: ...; Jetson: ...; nvidia-smi: ...'."""
        return "no GPU found: " + ("; ".join(self.notes) or "no source answered")

    def health(self) -> list[dict[str, Any]]:
        """Per-device health entries (empty without GPUs)."""
        return [g.health() for g in self.gpus]


class NoSource(Exception):
    """A source that cannot answer here; the message says why (goes into Inventory.notes)."""


# -- parsing (pure: tested with captured outputs) ------------------------------------------------

_SMI_ABSENT = {"[n/a]", "[not supported]", "n/a", ""}


def _smi_value(text: str, convert: Callable[[str], Any]) -> tuple[Any, Optional[str]]:
    """(value, error): '[N/A]' is no value; another bracketed text ('[GPU is lost]') is an error."""
    text = text.strip()
    if text.lower() in _SMI_ABSENT:
        return None, None
    if text.startswith("["):
        return None, text.strip("[]")
    try:
        return convert(text), None
    except ValueError:
        return None, f"unreadable value {text!r}"


def parse_nvidia_smi(text: str) -> list[GPU]:
    """GPUs from `nvidia-smi` run with NVIDIA_SMI_COMMAND (one CSV line per GPU)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_SMI_FIELDS):
            raise ValueError(f"expected {len(NVIDIA_SMI_FIELDS)} fields ({', '.join(NVIDIA_SMI_FIELDS)}), "
                             f"got {len(cells)}: {line!r}")
        errors = []
        values: dict[str, Any] = {}
        for name, cell, convert in zip(
            NVIDIA_SMI_FIELDS, cells, (int, str, str, lambda v: int(float(v)), lambda v: int(float(v)),
                                       float, float, str)):
            values[name], error = _smi_value(cell, convert)
            if error and name not in ("index", "name"):
                errors.append(f"{name}: {error}")
        gpus.append(GPU(
            index=values["index"] if values["index"] is not None else len(gpus),
            name=values["name"] or cells[2], memory_total_mib=values["memory.total"],
            memory_used_mib=values["memory.used"], utilization_percent=values["utilization.gpu"],
            temperature_c=values["temperature.gpu"], compute_capability=values["compute_cap"],
            uuid=values["uuid"], error="; ".join(errors) or None,
        ))
    return gpus


_TEGRA_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_TEGRA_GR3D = re.compile(r"\bGR3D(?:_FREQ)? (\d+)%")
_TEGRA_GPU_TEMP = re.compile(r"\bgpu@(-?\d+(?:\.\d+)?)C", re.IGNORECASE)


def parse_tegrastats(line: str) -> dict[str, Optional[float]]:
    """{'memory_used_mib', 'memory_total_mib', 'utilization_percent', 'temperature_c'} from one
    `tegrastats` line (None for what the line lacks; GR3D is the integrated GPU)."""
    ram, gr3d, temp = _TEGRA_RAM.search(line), _TEGRA_GR3D.search(line), _TEGRA_GPU_TEMP.search(line)
    celsius = float(temp.group(1)) if temp else None
    return {
        "memory_used_mib": int(ram.group(1)) if ram else None,
        "memory_total_mib": int(ram.group(2)) if ram else None,
        "utilization_percent": float(gr3d.group(1)) if gr3d else None,
        # -256C is how tegrastats shows a powered-off sensor (Orin's GPU zone when idle).
        "temperature_c": celsius if celsius is not None and celsius > -200 else None,
    }


def jetson_capability(model: str, compatible: Sequence[str] = ()) -> Optional[str]:
    """The compute capability of a Jetson module from its device-tree model or compatible strings."""
    for entry in compatible:
        for family, capability in _TEGRA_CAPABILITY.items():
            if family in entry:
                return capability
    lowered = model.lower()
    return next((cap for key, cap in _JETSON_CAPABILITY if key in lowered), None)


def visible(gpus: Sequence[GPU], cuda_visible_devices: Optional[str]) -> list[GPU]:
    """The GPUs CUDA shows under CUDA_VISIBLE_DEVICES (indices or UUID prefixes), renumbered from 0."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            break
        if token.lstrip("-").isdigit():
            match = next((g for g in gpus if g.index == int(token)), None)
        else:
            match = next((g for g in gpus if g.uuid and g.uuid.startswith(token)), None)
        if match is None:
            break  # CUDA stops at the first entry it cannot resolve
        chosen.append(match)
    return [replace(g, index=i) for i, g in enumerate(chosen)]


# -- sources --------------------------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml_ready = False


def read_nvml() -> list[GPU]:
    """GPUs through NVML; NoSource when pynvml or the driver's libnvidia-ml is missing."""
    global _nvml_ready
    if importlib.util.find_spec("pynvml") is None:
        raise NoSource("NVML: nvidia-ml-py not installed (pip install 'outrider[gpu]')")
    import pynvml

    with _nvml_lock:
        if not _nvml_ready:
            try:
                pynvml.nvmlInit()  # reference-counted by NVML; kept for the process's life
            except pynvml.NVMLError as exc:
                raise NoSource(f"NVML: {exc}") from None
            _nvml_ready = True
        count = pynvml.nvmlDeviceGetCount()
        gpus = [_nvml_gpu(pynvml, i) for i in range(count)]
    if not gpus:
        raise NoSource("NVML: the driver reports no GPU")
    return gpus


def _nvml_gpu(nv: Any, index: int) -> GPU:
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:  # e.g. GPU is lost: still listed, with the error
        return GPU(index, "unknown", error=str(exc))

    def ask(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except nv.NVMLError_NotSupported:
            return None
        except nv.NVMLError as exc:
            errors.append(str(exc))
            return None

    errors: list[str] = []
    name = ask(lambda: nv.nvmlDeviceGetName(handle))
    uuid = ask(lambda: nv.nvmlDeviceGetUUID(handle))
    memory = ask(lambda: nv.nvmlDeviceGetMemoryInfo(handle))
    rates = ask(lambda: nv.nvmlDeviceGetUtilizationRates(handle))
    temperature = ask(lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
    capability = ask(lambda: nv.nvmlDeviceGetCudaComputeCapability(handle))
    ecc = ask(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     nv.NVML_VOLATILE_ECC))
    if ecc:
        errors.append(f"{ecc} uncorrected ECC error(s) since the driver loaded")
    text = (lambda v: v.decode() if isinstance(v, bytes) else v)
    return GPU(
        index=index, name=text(name) or "unknown",
        memory_total_mib=memory.total >> 20 if memory else None,
        memory_used_mib=memory.used >> 20 if memory else None,
        utilization_percent=float(rates.gpu) if rates else None,
        temperature_c=float(temperature) if temperature is not None else None,
        compute_capability=f"{capability[0]}.{capability[1]}" if capability else None,
        uuid=text(uuid), error="; ".join(errors) or None,
    )


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(errors="replace").strip("\x00\n ")
    except OSError:
        return None


#: where the integrated GPU's load (per mille) lives, by Jetson generation.
_JETSON_LOAD = ("sys/devices/gpu.0/load", "sys/devices/platform/gpu.0/load",
                "sys/devices/platform/17000000.gpu/load", "sys/class/devfreq/17000000.gpu/device/load",
                "sys/devices/17000000.ga10b/load", "sys/devices/17000000.gv11b/load",
                "sys/devices/platform/bus@0/17000000.gpu/load")


def read_jetson(root: Path = Path("/"), tegrastats: Optional[str] = None) -> list[GPU]:
    """The integrated GPU of a Jetson from sysfs under `root` (or a `tegrastats` line when given)."""
    release = _read(root / "etc/nv_tegra_release")
    model = _read(root / "proc/device-tree/model") or ""
    if release is None and "jetson" not in model.lower():
        raise NoSource("Jetson: not a Jetson (/etc/nv_tegra_release absent)")
    compatible = (_read(root / "proc/device-tree/compatible") or "").split("\x00")
    stats: dict[str, Optional[float]] = {}
    if tegrastats:
        stats = parse_tegrastats(tegrastats)
    else:
        load = next((v for v in (_read(root / p) for p in _JETSON_LOAD) if v is not None), None)
        stats["utilization_percent"] = int(load) / 10 if load and load.isdigit() else None
        stats["temperature_c"] = _jetson_gpu_temperature(root)
        meminfo = _read(root / "proc/meminfo") or ""
        total = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
        available = re.search(r"MemAvailable:\s+(\d+) kB", meminfo)
        if total:
            stats["memory_total_mib"] = int(total.group(1)) >> 10
            if available:
                stats["memory_used_mib"] = (int(total.group(1)) - int(available.group(1))) >> 10
    return [GPU(
        index=0, name=model or "NVIDIA Jetson",
        memory_total_mib=_int(stats.get("memory_total_mib")), memory_used_mib=_int(stats.get("memory_used_mib")),
        utilization_percent=stats.get("utilization_percent"), temperature_c=stats.get("temperature_c"),
        compute_capability=jetson_capability(model, compatible), shared_memory=True,
    )]


def _int(value: Optional[float]) -> Optional[int]:
    return int(value) if value is not None else None


def _jetson_gpu_temperature(root: Path) -> Optional[float]:
    for zone in sorted((root / "sys/devices/virtual/thermal").glob("thermal_zone*")):
        kind = (_read(zone / "type") or "").lower()
        if kind in ("gpu-therm", "gpu-thermal", "gpu_therm"):
            value = _read(zone / "temp")
            if value and value.lstrip("-").isdigit() and int(value) > -200_000:  # -256000: sensor off
                return int(value) / 1000
    return None


def read_nvidia_smi(run: Optional[Callable[[Sequence[str]], str]] = None) -> list[GPU]:
    """GPUs from nvidia-smi's CSV query; NoSource when it is absent or fails."""
    if run is None:
        if shutil.which("nvidia-smi") is None:
            raise NoSource("nvidia-smi: not on PATH")
        run = _run_nvidia_smi
    import subprocess  # here, not at import: a start on a machine without nvidia-smi never needs it

    try:
        gpus = parse_nvidia_smi(run(NVIDIA_SMI_COMMAND))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise NoSource(f"nvidia-smi: {exc}") from None
    if not gpus:
        raise NoSource("nvidia-smi: lists no GPU")
    return gpus


def _run_nvidia_smi(command: Sequence[str]) -> str:
    import subprocess

    done = subprocess.run(list(command), capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        # e.g. "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver..."
        said = (done.stdout + done.stderr).strip().splitlines()
        raise subprocess.SubprocessError(said[0] if said else f"exit status {done.returncode}")
    return done.stdout


def probe(sources: Optional[Sequence[tuple[str, Callable[[], list[GPU]]]]] = None,
          cuda_visible_devices: Optional[str] = None) -> Inventory:
    """Ask each source in order (NVML, Jetson, nvidia-smi); the first that finds a GPU wins."""
    if sources is None:
        sources = (("nvml", read_nvml), ("jetson", read_jetson), ("nvidia-smi", read_nvidia_smi))
        cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    notes = []
    for name, read in sources:
        try:
            gpus = read()
        except NoSource as exc:
            notes.append(str(exc))
            continue
        except Exception as exc:  # a broken source must not hide the next one
            notes.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        shown = visible(gpus, cuda_visible_devices)
        if not shown:
            notes.append(f"{name}: {len(gpus)} GPU(s), none of them in CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
            return Inventory((), "none", tuple(notes))
        return Inventory(tuple(shown), name, tuple(notes))
    return Inventory((), "none", tuple(notes))
