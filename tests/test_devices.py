"""The device inventory, placement, `device: auto` and GPU health, on a machine without a GPU.

Sources parse captured outputs (nvidia-smi CSV from H200 and A100 hosts, tegrastats lines and a
sysfs tree from a Jetson AGX Orin); the server tests install a fixed inventory with
`devices.set_provider`, the hook a host with its own view of its GPUs would use.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from outrider import devices
from outrider.backend import BackendChoice
from outrider.client import Client
from outrider.devices import GPU, Inventory
from outrider.manifest import validate_manifest
from outrider.serving.served_model import ServedModel
from outrider.plugins import create_registry
from outrider.server import Server, ServerConfig

PLUGINS = Path(__file__).resolve().parent / "plugins"

# nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu,compute_cap
#            --format=csv,noheader,nounits
H200_SMI = """\
0, GPU-1f6c2a53-7c1e-8d4b-0a0e-6b2c1d3e4f50, NVIDIA H200, 143771, 4608, 37, 41, 9.0
1, GPU-9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4, NVIDIA H200, 143771, 1, 0, 29, 9.0
"""
# An A100 in MIG mode reports no utilization; a GPU that fell off the bus says so in every field.
A100_SMI = """\
0, GPU-3c2b1a09-8f7e-6d5c-4b3a-291807f6e5d4, NVIDIA A100-SXM4-80GB, 81920, 17, [N/A], 33, 8.0
1, GPU-77aa66bb-55cc-44dd-33ee-22ff11009988, NVIDIA A100-SXM4-80GB, [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost]
"""
# tegrastats on a Jetson AGX Orin, JetPack 6 (lower-case sensors) and JetPack 5 (GPU sensor off: -256C).
ORIN_TEGRASTATS = (
    "11-08-2024 14:03:12 RAM 5423/62841MB (lfb 9811x4MB) SWAP 0/31421MB (cached 0MB) "
    "CPU [3%@1190,1%@1190,0%@1190,0%@1190,2%@1190,0%@1190,0%@1190,0%@1190,off,off,off,off] "
    "EMC_FREQ 1%@3199 GR3D_FREQ 47%@[1300,1300] NVENC off NVDEC off NVJPG off VIC off OFA off "
    "APE 174 cpu@48.343C soc2@44.812C soc0@45.937C gpu@46.156C tj@48.343C soc1@45.218C "
    "VDD_GPU_SOC 4792mW/4792mW VDD_CPU_CV 799mW/799mW VIN_SYS_5V0 4327mW/4327mW"
)
ORIN_TEGRASTATS_JP5_IDLE = (
    "RAM 3110/30536MB (lfb 6312x4MB) SWAP 0/15268MB (cached 0MB) CPU [2%@729,0%@729,0%@729,0%@729] "
    "EMC_FREQ 0%@2133 GR3D_FREQ 0%@[305,305] VIC_FREQ 729 APE 174 CV0@-256C CPU@45.687C Tboard@34C "
    "SOC2@42.562C Tdiode@35.25C SOC0@43.093C CV1@-256C GPU@-256C tj@45.687C SOC1@42.093C CV2@-256C"
)
NANO_TEGRASTATS = ("RAM 3468/3983MB (lfb 48x4MB) SWAP 873/8192MB (cached 295MB) cpu [17%,13%,29%,5%]@408 "
                   "EMC 1%@408 APE 25 GR3D 3%@76")


def smi(text: str):
    """A nvidia-smi runner that answers with captured output (and checks the query it was given)."""
    def run(command):
        assert list(command) == list(devices.NVIDIA_SMI_COMMAND)
        return text
    return run


def h200s() -> Inventory:
    return Inventory(tuple(devices.parse_nvidia_smi(H200_SMI)), "nvml")


@pytest.fixture
def fixed_inventory() -> Iterator[callable]:
    """Install an inventory for the test; the real probe again afterwards."""
    def install(found: Inventory) -> None:
        devices.set_provider(lambda: found)

    yield install
    devices.set_provider(None)


def orin_tree(root: Path) -> Path:
    """The files a Jetson AGX Orin (JetPack 6) shows, under `root`."""
    files = {
        "etc/nv_tegra_release": "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64\n",
        "proc/device-tree/model": "NVIDIA Jetson AGX Orin Developer Kit\x00",
        "proc/device-tree/compatible": "nvidia,p3737-0000+p3701-0005\x00nvidia,p3701-0005\x00nvidia,tegra234\x00",
        "sys/devices/platform/gpu.0/load": "473\n",
        "sys/devices/virtual/thermal/thermal_zone0/type": "cpu-thermal\n",
        "sys/devices/virtual/thermal/thermal_zone0/temp": "48343\n",
        "sys/devices/virtual/thermal/thermal_zone1/type": "gpu-thermal\n",
        "sys/devices/virtual/thermal/thermal_zone1/temp": "46156\n",
        "proc/meminfo": "MemTotal:       64349412 kB\nMemFree:        55012345 kB\nMemAvailable:   58795432 kB\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# -- parsing -------------------------------------------------------------------------------------

def test_nvidia_smi_csv_of_an_h200_host() -> None:
    gpus = devices.parse_nvidia_smi(H200_SMI)
    assert [g.device for g in gpus] == ["cuda:0", "cuda:1"]
    first = gpus[0]
    assert (first.name, first.memory_total_mib, first.memory_used_mib) == ("NVIDIA H200", 143771, 4608)
    assert (first.utilization_percent, first.temperature_c, first.compute_capability) == (37.0, 41.0, "9.0")
    assert first.uuid.startswith("GPU-1f6c2a53") and first.error is None
    assert first.label() == "NVIDIA H200, 140 GiB"


def test_nvidia_smi_not_available_is_no_value_and_a_lost_gpu_is_an_error() -> None:
    mig, lost = devices.parse_nvidia_smi(A100_SMI)
    assert mig.utilization_percent is None and mig.error is None and mig.compute_capability == "8.0"
    assert lost.memory_total_mib is None and "GPU is lost" in lost.error


def test_nvidia_smi_output_of_another_query_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 8 fields"):
        devices.parse_nvidia_smi("0, NVIDIA H200, 143771, 4608, 37, 41, 9.0\n")


def test_tegrastats_lines_of_three_jetsons() -> None:
    assert devices.parse_tegrastats(ORIN_TEGRASTATS) == {
        "memory_used_mib": 5423, "memory_total_mib": 62841, "utilization_percent": 47.0, "temperature_c": 46.156}
    idle = devices.parse_tegrastats(ORIN_TEGRASTATS_JP5_IDLE)
    assert idle["utilization_percent"] == 0.0 and idle["temperature_c"] is None  # -256C: sensor off
    nano = devices.parse_tegrastats(NANO_TEGRASTATS)
    assert (nano["memory_total_mib"], nano["utilization_percent"], nano["temperature_c"]) == (3983, 3.0, None)


def test_jetson_orin_from_sysfs(tmp_path: Path) -> None:
    (gpu,) = devices.read_jetson(orin_tree(tmp_path))
    assert gpu.name == "NVIDIA Jetson AGX Orin Developer Kit" and gpu.compute_capability == "8.7"
    assert gpu.utilization_percent == 47.3 and gpu.temperature_c == 46.156
    assert gpu.memory_total_mib == 64349412 >> 10 and gpu.memory_used_mib == (64349412 - 58795432) >> 10
    assert gpu.shared_memory and gpu.label().endswith("GiB shared")


def test_jetson_from_a_tegrastats_line_and_not_a_jetson(tmp_path: Path) -> None:
    (gpu,) = devices.read_jetson(orin_tree(tmp_path / "orin"), tegrastats=ORIN_TEGRASTATS)
    assert (gpu.memory_used_mib, gpu.utilization_percent) == (5423, 47.0)
    (tmp_path / "plain").mkdir()
    with pytest.raises(devices.NoSource, match="not a Jetson"):
        devices.read_jetson(tmp_path / "plain")


def test_compute_capability_of_jetson_modules() -> None:
    assert devices.jetson_capability("", ["nvidia,p3450-0000", "nvidia,tegra210"]) == "5.3"
    assert devices.jetson_capability("NVIDIA Jetson Xavier NX Developer Kit") == "7.2"
    assert devices.jetson_capability("NVIDIA Jetson Orin Nano Developer Kit") == "8.7"  # Orin before Nano
    assert devices.jetson_capability("some board") is None


# -- sources in order ----------------------------------------------------------------------------

def test_without_nvml_the_next_source_answers_and_the_notes_say_why(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    found = devices.probe([("nvml", devices.read_nvml), ("jetson", lambda: devices.read_jetson(tmp_path / "none")),
                           ("nvidia-smi", lambda: devices.read_nvidia_smi(smi(H200_SMI)))])
    assert found.source == "nvidia-smi" and found.count == 2
    if importlib.util.find_spec("pynvml") is None:
        assert found.notes[0] == "NVML: nvidia-ml-py not installed (pip install 'outrider[gpu]')"
    assert found.notes[-1] == "Jetson: not a Jetson (/etc/nv_tegra_release absent)"


def test_a_jetson_answers_before_nvidia_smi(tmp_path: Path) -> None:
    found = devices.probe([("jetson", lambda: devices.read_jetson(orin_tree(tmp_path))),
                           ("nvidia-smi", lambda: devices.read_nvidia_smi(smi(H200_SMI)))])
    assert found.source == "jetson" and found.gpus[0].compute_capability == "8.7"


def test_no_gpu_anywhere_says_why_for_every_source(tmp_path: Path) -> None:
    def failing(command):
        raise subprocess.SubprocessError(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")

    found = devices.probe([("jetson", lambda: devices.read_jetson(tmp_path)),
                           ("nvidia-smi", lambda: devices.read_nvidia_smi(failing))])
    assert found.source == "none" and not found.gpus
    assert found.why_none() == ("no GPU found: Jetson: not a Jetson (/etc/nv_tegra_release absent); "
                                "nvidia-smi: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_this_machine_probes_without_error() -> None:
    found = devices.probe()  # whatever this machine has; on CI: no GPU, and why
    assert found.gpus or found.why_none().startswith("no GPU found: NVML")


def test_cuda_visible_devices_renumbers_as_cuda_does() -> None:
    gpus = devices.parse_nvidia_smi(H200_SMI)
    assert [(g.index, g.uuid[:12]) for g in devices.visible(gpus, "1")] == [(0, "GPU-9a8b7c6d")]
    assert [g.uuid[:12] for g in devices.visible(gpus, "GPU-9a8b,0")] == ["GPU-9a8b7c6d", "GPU-1f6c2a53"]
    assert [g.index for g in devices.visible(gpus, "0,7,1")] == [0]  # CUDA stops at the first it cannot find
    assert devices.visible(gpus, "-1") == [] and devices.visible(gpus, "") == []
    found = devices.probe([("nvidia-smi", lambda: gpus)], cuda_visible_devices="-1")
    assert found.source == "none" and "CUDA_VISIBLE_DEVICES='-1'" in found.why_none()


# -- the cached snapshot ---------------------------------------------------------------------------

def test_the_snapshot_is_probed_once_and_refreshed_in_the_background() -> None:
    calls = []

    def provider() -> Inventory:
        calls.append(time.monotonic())
        return h200s()

    devices.set_provider(provider)
    try:
        first = devices.inventory()
        assert devices.inventory() is first and len(calls) == 1
        stale_read = devices.inventory(max_age_s=0)  # stale: answered at once, refreshed behind
        assert stale_read is first
        deadline = time.monotonic() + 5
        while devices.inventory(max_age_s=60) is first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 2 and devices.inventory(max_age_s=60) is not first
    finally:
        devices.set_provider(None)


def test_a_machine_without_gpus_is_not_probed_again() -> None:
    calls = []
    devices.set_provider(lambda: calls.append(1) or Inventory((), "none", ("nvidia-smi: not on PATH",)))
    try:
        for _ in range(3):
            assert devices.inventory(max_age_s=0).count == 0
        time.sleep(0.05)
        assert len(calls) == 1
    finally:
        devices.set_provider(None)


# -- placement and device: auto --------------------------------------------------------------------

def test_instances_spread_over_gpus_and_skip_a_failing_one() -> None:
    assert devices.place(5, "cuda", h200s()) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert devices.place(3, "cuda:1", h200s()) == ["cuda:1"] * 3  # an explicit GPU stays put
    assert devices.place(2, "cpu", h200s()) == ["cpu", "cpu"]
    a100 = Inventory(tuple(devices.parse_nvidia_smi(A100_SMI)), "nvidia-smi")
    assert devices.place(3, "cuda", a100) == ["cuda:0"] * 3
    assert devices.place(2, "cuda", Inventory()) == ["cuda:0", "cuda:0"]


def test_served_model_places_instances_from_the_inventory() -> None:
    registry = create_registry(modules=["outrider_echo"], load_entry_points=False)
    manifest = validate_manifest({"name": "m", "backend": "echo", "device": "cpu", "instances": 3}, where="t.yaml")
    echo = registry.backends["echo"]
    on_cuda = ServedModel(manifest, BackendChoice(echo, "cuda"), make_task=lambda: None)
    assert on_cuda.devices(h200s()) == ["cuda:0", "cuda:1", "cuda:0"]
    on_cpu = ServedModel(manifest, BackendChoice(echo, "cpu"), make_task=lambda: None)
    assert on_cpu.devices(h200s()) == ["cpu"] * 3


def test_auto_names_the_gpus_or_why_none() -> None:
    assert devices.explain("auto", "cuda", h200s()) == \
        "cuda:0 (NVIDIA H200, 140 GiB), cuda:1 (NVIDIA H200, 140 GiB) via nvml"
    none = Inventory((), "none", ("NVML: nvidia-ml-py not installed (pip install 'outrider[gpu]')",
                                  "Jetson: not a Jetson (/etc/nv_tegra_release absent)", "nvidia-smi: not on PATH"))
    assert devices.explain("auto", "cpu", none) == (
        "cpu: no GPU found: NVML: nvidia-ml-py not installed (pip install 'outrider[gpu]'); "
        "Jetson: not a Jetson (/etc/nv_tegra_release absent); nvidia-smi: not on PATH")
    assert devices.explain("auto", "cpu", h200s(), kinds=("cpu",)) == "cpu: the backend runs on cpu only"
    assert devices.explain("cuda:1", "cuda:1", h200s()) == "cuda:1: as the manifest asks"


def test_auto_picks_cuda_when_the_inventory_has_a_gpu(monkeypatch: pytest.MonkeyPatch, fixed_inventory) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    registry = create_registry(modules=["outrider_echo", "outrider_test_gpu"], load_entry_points=False)
    manifest = validate_manifest({"name": "m", "backend": ["placed-echo"], "device": "auto"}, where="t.yaml")
    fixed_inventory(h200s())
    choice = registry.choose_backend(manifest)
    assert choice.device == "cuda" and choice.device_reason.startswith("cuda:0 (NVIDIA H200, 140 GiB)")
    fixed_inventory(Inventory((), "none", ("nvidia-smi: not on PATH",)))
    choice = registry.choose_backend(manifest)
    assert (choice.device, choice.device_reason) == ("cpu", "cpu: no GPU found: nvidia-smi: not on PATH")
    echo = validate_manifest({"name": "e", "backend": "echo", "device": "auto"}, where="t.yaml")
    fixed_inventory(h200s())
    assert registry.choose_backend(echo).device == "cpu"  # echo runs on the CPU only


def test_out_of_memory_is_recognised_as_torch_ort_and_tensorrt_say_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    from outrider_test_gpu import ORT_CUDA_OOM

    said = [
        RuntimeError(ORT_CUDA_OOM),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; "
                     "77.02 GiB already allocated; 1.06 GiB free; 77.50 GiB reserved in total by PyTorch)"),
        RuntimeError("[virtualMemoryBuffer.cpp::resizePhysical::140] Error Code 2: OutOfMemory (no further information)"),
        MemoryError(),
    ]
    assert all(devices.is_out_of_memory(e) for e in said)
    assert not devices.is_out_of_memory(ValueError("input 'text' has shape [2]; expected [-1, 4]"))
    reason = devices.out_of_memory_reason("cuda:0", said[0], h200s())
    assert reason.startswith("out of GPU memory on cuda:0 (NVIDIA H200: 4608/143771 MiB in use): RuntimeError:")


# -- health on a served model ----------------------------------------------------------------------

@pytest.fixture
def gpu_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_inventory):
    """An in-process server over the test GPU backends, with the inventory the test installs."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    servers = []

    def start(found: Inventory, manifests: list[dict]) -> tuple[Server, Client]:
        fixed_inventory(found)
        registry = create_registry(modules=["outrider_test_gpu"], load_entry_points=False)
        server = Server([validate_manifest(m, where="t.yaml") for m in manifests], registry,
                        ServerConfig(address=f"ipc://{tmp_path}/gpu.sock"))
        server.start()
        servers.append(server)
        return server, Client(server.address, timeout=10)

    yield start
    for server in servers:
        server.shutdown(drain_timeout=1)


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_health_lists_each_gpu_and_where_each_instance_went(gpu_server) -> None:
    server, client = gpu_server(h200s(), [{"name": "m", "backend": "placed-echo", "device": "auto", "instances": 3,
                                           "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}]}])
    assert server.wait_ready(10)
    with client:
        health = client.health()
        out = client.infer("m", {"x": np.arange(3, dtype=np.float32)})
    assert out["x"].tolist() == [0.0, 1.0, 2.0]
    assert health["devices_source"] == "nvml"
    assert health["devices"][0] == {
        "device": "cuda:0", "name": "NVIDIA H200", "memory_used_mib": 4608, "memory_total_mib": 143771,
        "utilization_percent": 37.0, "temperature_c": 41.0, "compute_capability": "9.0", "error": None}
    model = health["models"]["m"]
    assert [i["device"] for i in model["instances"]] == ["cuda:0", "cuda:1", "cuda:0"]
    assert model["device_reason"].startswith("cuda:0 (NVIDIA H200, 140 GiB), cuda:1")
    from outrider.cli import _gpu_line
    assert _gpu_line(health["devices"][0]) == "4608/143771 MiB, 37% busy, 41 C"


def test_no_device_section_without_gpus(gpu_server) -> None:
    server, client = gpu_server(Inventory((), "none", ("nvidia-smi: not on PATH",)),
                                [{"name": "m", "backend": "placed-echo", "device": "auto"}])
    assert server.wait_ready(10)
    with client:
        health = client.health()
    assert "devices" not in health
    assert health["models"]["m"]["device_reason"] == "cpu: no GPU found: nvidia-smi: not on PATH"


def test_a_gpu_reporting_an_error_takes_its_instances_out_of_service(gpu_server) -> None:
    server, client = gpu_server(h200s(), [{"name": "m", "backend": "placed-echo", "device": "cuda", "instances": 2}])
    assert server.wait_ready(10)
    lost = GPU(1, "NVIDIA H200", error="GPU is lost")
    devices.set_provider(lambda: Inventory((h200s().gpus[0], lost), "nvml"))
    health = wait_for(lambda: (h := server.health())["models"]["m"]["state"] == "degraded" and h)
    instance = health["models"]["m"]["instances"][1]
    assert instance["device"] == "cuda:1" and not instance["serving"]
    assert instance["reason"] == "cuda:1 (NVIDIA H200) reports an error: GPU is lost"
    assert health["models"]["m"]["ready"]  # cuda:0 still serves
    assert health["devices"][1]["error"] == "GPU is lost"


def test_out_of_memory_during_warmup_leaves_the_model_not_ready_saying_so(gpu_server) -> None:
    server, client = gpu_server(h200s(), [{"name": "m", "backend": "oom-warmup", "device": "cuda:1"}])
    health = wait_for(lambda: (h := server.health())["models"]["m"]["state"] == "failed" and h)
    assert not health["ready"]
    assert "load or warmup failed: out of GPU memory on cuda:1 (NVIDIA H200: 1/143771 MiB in use)" in \
        health["models"]["m"]["reason"]
    json.dumps(health)  # what `outrider health --json` prints
