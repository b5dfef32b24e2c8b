"""What a run costs: model FLOPs utilisation (MFU) against a peak, and peak memory.

MFU = achieved model FLOPs / peak FLOPs. Model FLOPs per target come from the model's own
`flops_per_token()` when it has one (the lm GPT counts attention too), else 6 x parameters
(forward + backward of a dense network). The peak is `trainer.peak_tflops` if given, a table of
common GPUs' dense bf16/fp16 peaks, or on a CPU a short matmul probe (`cpu_peak_tflops`): the process's
threads x one thread's best matmul throughput in fp32 or the run's dtype, whichever is faster. So a run
in a dtype this CPU only emulates (fp16 on most CPUs, bf16 without avx512_bf16/amx_bf16) is measured
against what the CPU does in fp32, and its low MFU shows what the choice costs.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.nn as nn

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of the device name.
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A10G": 125.0, "A10": 125.0, "L40S": 362.0,
    "L4": 121.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0,
}


def flops_per_target(model: nn.Module) -> float:
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token())
    return 6.0 * sum(p.numel() for p in model.parameters())


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


def cpu_peak_tflops(dtype: torch.dtype) -> float:
    """The peak of this process on a CPU: its threads x one thread's best matmul throughput in the faster of
    fp32 and `dtype` (~0.1 s, in rounds). Still a measurement, so it can read low on a busy machine: `Cost`
    raises it to any throughput the run reaches."""
    return torch.get_num_threads() * max(best_matmul_tflops((torch.float32, dtype)).values())


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Cost:
    """Turns tokens/s into MFU; measured once at start (the CPU probe) so the loop pays nothing.

    MFU is at most 1 by construction: the peak is a lower bound on what the device can do (a probe reads low
    when another process took the core; a stated peak may be too low), and so is any throughput the run
    reaches. When a log window computes faster than the peak, that throughput becomes the peak (said once)."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, peak_tflops: float | None,
                 world_size: int = 1, say=print):
        self.device, self.flops_per_target = device, flops_per_target(model)
        if peak_tflops is not None:
            self.source = f"trainer.peak_tflops={peak_tflops} is below what this run reached"
        elif device.type == "cuda":
            peak_tflops, self.source = gpu_peak_tflops(device), "the GPU table's peak is below what this run reached"
        else:
            peak_tflops = cpu_peak_tflops(dtype)
            self.source = "the CPU probe's peak (measured while the machine was busy?) is below what this run reached"
        self.peak_tflops = peak_tflops  # per process
        self.world_size, self.say, self.raised = world_size, say, False

    def metrics(self, targets_per_s: float) -> dict[str, float]:
        out = {"train/peak_mem_mb": peak_memory_mb(self.device)}
        if self.peak_tflops:
            achieved = self.flops_per_target * targets_per_s / self.world_size / 1e12  # TFLOP/s per process
            if achieved > self.peak_tflops:
                if not self.raised:
                    self.say(f"note: {self.source} ({self.peak_tflops:.3g} against {achieved:.3g} TFLOP/s per "
                             "process): train/mfu now counts against the highest throughput reached, so it stays at or "
                             "below 1. Set trainer.peak_tflops to the device's real peak for a fixed one.", flush=True)
                    self.raised = True
                self.peak_tflops = achieved
            out["train/mfu"] = achieved / self.peak_tflops
        return out


class Throughput:
    """Training time and targets per log window and over the whole run; eval and checkpoints excluded.

    `add` takes a step's target count as it comes (a number, or a device tensor that is only read at
    `window()`, so the loop adds no host sync)."""

    def __init__(self):
        self.run_seconds, self.run_targets, self.run_steps = 0.0, 0.0, 0
        self.restart()

    def restart(self) -> None:
        """Start a new window now (after eval or a checkpoint save: not training time)."""
        self.start, self.targets, self.steps = time.perf_counter(), 0, 0

    def add(self, targets) -> None:
        self.targets += targets
        self.steps += 1

    def window(self, samples_per_step: int) -> dict[str, float]:
        """Rates of the window since the last one; starts the next."""
        elapsed = time.perf_counter() - self.start
        targets = float(self.targets)
        self.run_seconds, self.run_targets, self.run_steps = (self.run_seconds + elapsed, self.run_targets + targets,
                                                              self.run_steps + self.steps)
        out = {"targets_per_s": targets / elapsed, "samples_per_s": self.steps * samples_per_step / elapsed,
               "step_time_ms": 1000 * elapsed / max(self.steps, 1)}
        self.restart()
        return out
