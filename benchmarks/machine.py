"""What the benchmarks say about where they ran: the machine (host and GPU, `machine`), its GPU memory's bandwidth
for the bandwidth bounds of decode steps (`hbm_tb_s`, by the GPU's name), the code measured (`code_hash`) and the
GPUs' clocks while a side ran (`GpuClocks`)."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("megatron_patch", "benchmarks")
# HBM bandwidth by GPU (NVIDIA's data sheets, TB/s): the first name found in the device's name wins
HBM_TB_S = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35), ("H20", 4.0),
            ("GH200", 4.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555))
DEFAULT_TB_S = 4.8  # the H200 most rows of docs/benchmarks.md were measured on
# nvidia-smi's fields sampled while a side runs; the clock-event reasons' bits (NVML's nvmlClocksEventReason*):
# idle samples are left out, the others counted per reason that lowers the SM clock
CLOCK_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active,utilization.gpu"
OLD_CLOCK_QUERY = CLOCK_QUERY.replace("clocks_event_reasons", "clocks_throttle_reasons")  # drivers before 535
IDLE = 0x1
# a sample counts as the side's work where a kernel ran for at least this share of nvidia-smi's last sample
# period: a process holding the GPU clears the idle bit while it builds the model, loads or compiles, at full clock
# and a fifth of the power (2026-12-06: medians of 127-150 W for our rows, 690 W for HF's, before this)
BUSY_PERCENT = 50
SLOWDOWNS = (("power cap", 0x4), ("hw slowdown", 0x8), ("sw thermal", 0x20), ("hw thermal", 0x40),
             ("power brake", 0x80))


def code_hash(root: str = ROOT) -> str:
    """sha256 (first 16 hex digits) of the project's Python sources (`SOURCES`), paths and contents: the same on
    the GPU machine's copy of the working tree as here, where git's commit is not at hand there."""
    digest = hashlib.sha256()
    for top in SOURCES:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def machine() -> dict:
    """The host name and, where there is a GPU, its name, UUID (the same card across calls) and count."""
    out = {"host": socket.gethostname()}
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, gpu_uuid=str(getattr(props, "uuid", "")), gpus=torch.cuda.device_count())
    except ImportError:
        pass
    return out


def hbm_tb_s(gpu_name: str | None) -> float:
    """The HBM bandwidth of the GPU named `gpu_name` (TB/s), DEFAULT_TB_S for a name not in HBM_TB_S (or none:
    a CPU run, whose bound is arithmetic only)."""
    for key, tb_s in HBM_TB_S:
        if gpu_name and key in gpu_name:
            return tb_s
    return DEFAULT_TB_S


def bandwidth_tb_s(given: float | None, on_gpu: bool = True) -> float:
    """The bandwidth a bound divides by: `given` (a script's --bandwidth-tb-s), else this machine's GPU's
    (`hbm_tb_s`; DEFAULT_TB_S off a GPU)."""
    if given:
        return given
    import torch

    return hbm_tb_s(torch.cuda.get_device_name() if on_gpu and torch.cuda.is_available() else None)


def summarise_clocks(text: str) -> dict | None:
    """From nvidia-smi's CSV samples (`CLOCK_QUERY`, no header, no units; every GPU's line per sample) of a side's
    run: over the samples of a busy GPU (the idle-reason bit clear and at least `BUSY_PERCENT` utilization: model
    build, loading and compiling left out), the median and lowest SM clock (MHz), the median power draw (W), the
    highest temperature (°C) and, per reason that slows the clock (`SLOWDOWNS`), the share of samples it was active
    in. None without a busy sample."""
    busy = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            mhz, watts, temp, reasons = float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 16)
            utilization = float(fields[4])
        except (ValueError, IndexError):  # "[N/A]", a cut last line
            continue
        if not reasons & IDLE and utilization >= BUSY_PERCENT:
            busy.append((mhz, watts, temp, reasons))
    if not busy:
        return None
    return {"sm_mhz": round(statistics.median(b[0] for b in busy)), "sm_mhz_min": round(min(b[0] for b in busy)),
            "power_w": round(statistics.median(b[1] for b in busy)), "temp_c_max": round(max(b[2] for b in busy)),
            "samples": len(busy),
            "slowed": {name: round(sum(1 for b in busy if b[3] & bit) / len(busy), 2) for name, bit in SLOWDOWNS
                       if any(b[3] & bit for b in busy)}}


@functools.cache
def _clock_query(exe: str) -> str | None:
    """The sampled fields' names this driver's nvidia-smi takes (`CLOCK_QUERY`, or the older `OLD_CLOCK_QUERY`),
    None where it takes neither."""
    for query in (CLOCK_QUERY, OLD_CLOCK_QUERY):
        try:
            if subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                              timeout=30).returncode == 0:
                return query
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


class GpuClocks:
    """Samples the GPUs' SM clock, power draw, temperature and clock-event reasons every `interval_ms` (nvidia-smi
    in the background) while the `with` block runs; `summary` afterwards (`summarise_clocks`), None where there is
    no nvidia-smi or no busy sample. A row measured at a lowered clock (a power cap, heat) then reads as such, not
    as a slower code path."""

    def __init__(self, interval_ms: int = 500):
        self.interval_ms, self.summary, self._proc = interval_ms, None, None

    def __enter__(self) -> GpuClocks:
        exe = shutil.which("nvidia-smi")
        query = exe and _clock_query(exe)
        if query:
            self._proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.summary = summarise_clocks(out or "")
