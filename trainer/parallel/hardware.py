"""What this machine's devices can do, measured or looked up: a GPU's dense peak from a table, a CPU's from a short
matmul probe (one thread's best throughput, in rounds), and a process's peak memory. Used by `precision=auto`
(is bf16 native here?) and by the run's MFU (trainer/loop/metrics.py)."""

from __future__ import annotations

import resource
import time

import torch

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of the device name.
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A10G": 125.0, "A10": 125.0, "L40S": 362.0,
    "L4": 121.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0,
}


def gpu_peak_tflops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, tflops in GPU_PEAK_TFLOPS.items():  # ordered: specific names first
        if key in name:
            return tflops
    return None


def cpu_matmul_tflops(dtype: torch.dtype, size: int = 512, seconds: float = 0.05) -> float:
    """One CPU thread's best throughput on a `size` x `size` matmul in `dtype`, over ~`seconds` (at least one
    matmul: an emulated fp16 one of 512 takes ~0.1 s). One thread, because a probe that needs every core at
    once is ruined by any other process on the machine, and one that needs a single core is not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        best, deadline = 0.0, time.perf_counter() + seconds
        while True:  # the first matmul also selects the kernel: the best of the later ones counts
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - t))
            if time.perf_counter() >= deadline:
                return best / 1e12
    finally:
        torch.set_num_threads(threads)


PROBE_ROUNDS = 3


def best_matmul_tflops(dtypes, size: int = 512, seconds: float = 0.05, rounds: int = PROBE_ROUNDS) -> dict:
    """Each dtype's best one-thread matmul throughput over `rounds` rounds that alternate the dtypes (~`seconds`
    per dtype in all). Another process that takes the core for a while slows every matmul of the round it falls
    in, and a probe of one window per dtype then reads that window alone (bf16 at "0.01x" fp32 on a loaded
    machine); one undisturbed round per dtype is enough here."""
    best = dict.fromkeys(dtypes, 0.0)
    for _ in range(rounds):
        for dtype in best:
            best[dtype] = max(best[dtype], cpu_matmul_tflops(dtype, size=size, seconds=seconds / rounds))
    return best


# One thread's best matmul TFLOP/s per dtype, probed once per process: the cores do not change while it runs, and
# every run of a process (the tests', a sweep's in-process jobs, `tune`'s trials) paid ~0.1 s of CPU for the probe
# again. (A launch's workers fork from a forkserver that has only imported modules: each probes once.)
_ONE_THREAD: dict[torch.dtype, float] = {}


def cpu_peak_tflops(dtype: torch.dtype) -> float:
    """The peak of this process on a CPU: its threads x one thread's best matmul throughput in the faster of
    fp32 and `dtype` (~0.1 s, in rounds, the first time). Still a measurement, so it can read low on a busy
    machine: `Cost` raises it to any throughput the run reaches."""
    missing = [d for d in dict.fromkeys((torch.float32, dtype)) if d not in _ONE_THREAD]
    if missing:
        _ONE_THREAD.update(best_matmul_tflops(missing))
    return torch.get_num_threads() * max(_ONE_THREAD[torch.float32], _ONE_THREAD[dtype])


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
