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

import time

import torch
import torch.nn as nn

from trainer.parallel.hardware import cpu_peak_tflops, gpu_peak_tflops, peak_memory_mb


def flops_per_target(model: nn.Module) -> float:
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token())
    return 6.0 * sum(p.numel() for p in model.parameters())


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
    `window()` or `totals()`, so the loop adds no host sync)."""

    def __init__(self):
        self.run_seconds, self.run_targets, self.run_steps = 0.0, 0.0, 0
        self._new_window()

    def _new_window(self) -> None:
        self.start = self.last = time.perf_counter()
        self.elapsed, self.targets, self.steps = 0.0, 0, 0

    def restart(self) -> None:
        """After an eval or a checkpoint save, which are not training time: the window goes on from now, keeping its
        steps and their time up to the last one. (It once started over, and the steps of the window so far were
        lost from the run's totals: a run saving every 7 steps and logging every 13 counted a third of its time.)"""
        self.elapsed += self.last - self.start
        self.start = self.last = time.perf_counter()

    def add(self, targets) -> None:
        self.targets += targets
        self.steps += 1
        self.last = time.perf_counter()

    def window(self, samples_per_step: int) -> dict[str, float]:
        """Rates of the window since the last one; starts the next."""
        elapsed = self.elapsed + time.perf_counter() - self.start
        targets = float(self.targets)
        self.run_seconds, self.run_targets, self.run_steps = (self.run_seconds + elapsed, self.run_targets + targets,
                                                              self.run_steps + self.steps)
        out = {"targets_per_s": targets / elapsed, "samples_per_s": self.steps * samples_per_step / elapsed,
               "step_time_ms": 1000 * elapsed / max(self.steps, 1)}
        self._new_window()
        return out

    def totals(self) -> tuple[float, float]:
        """(seconds, targets) of the run's training so far: the closed windows and the open one up to its last step."""
        return (self.run_seconds + self.elapsed + self.last - self.start,
                self.run_targets + float(self.targets))
