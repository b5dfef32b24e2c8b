"""Numerical precision: one small class per mode, selected by `precision=fp32|bf16|fp16|auto`.

Each exposes the same narrow interface the training step uses, in this order:
`autocast()` around forward + loss, `backward(loss)`, `unscale_(opt)` before clipping,
`step(opt) -> bool` (False when the step was skipped), and `state_dict()` for checkpoints; plus what
other components need to know: `dtype` (the compute dtype: the MFU probe), `mixed_precision_policy()`
(what FSDP casts to), whether the mode skips steps itself (`skips_own_steps`: fp16's loss scaler) and how
(`close_skipped_step`, `skip_was_routine`, which the non-finite guard asks), and `reason` (why this mode).

A precision is built for the strategy it serves (`sharded=True` when gradients are sharded over ranks:
FSDP, tensor parallelism), as Lightning Fabric's precision plugins are; nothing changes it afterwards, and
the strategy checks the pairing in its setup.

`precision=auto` is not a mode but a rule (`choose`): bf16 where the device computes it natively, fp16
with loss scaling on older CUDA GPUs, fp32 otherwise. `resolve_auto` applies it once per job, before any
worker starts, so every rank computes in the same mode and the run dir's config.yaml names it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.errors import ConfigError


class FP32:
    """Full precision: every method is the plain PyTorch call."""

    name = "fp32"
    dtype = torch.float32
    scaler: torch.amp.GradScaler | None = None
    skips_own_steps = False  # whether step() may refuse a step by itself (fp16's loss scaler)

    def __init__(self, device_type: str = "cpu", reason: str | None = None, sharded: bool = False):
        self.device_type = device_type
        self.reason = reason or "set in the config"  # precision=auto's reason when it chose this mode
        self.sharded = sharded  # built for a strategy whose gradients are sharded over ranks

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def close_skipped_step(self) -> None:
        """After unscale_, the step will not be taken (a non-finite loss): end it without stepping."""

    def skip_was_routine(self) -> bool:
        """Whether the step `step()` just refused was this mode's routine business (an fp16 overflow while the
        loss scale is still >= 1), not a sign of non-finite gradients."""
        return False

    def mixed_precision_policy(self):
        """FSDP2's policy: parameters gathered in the compute dtype, gradients reduced in fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.dtype == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def state_dict(self) -> dict:
        # The same keys in every mode, so that a checkpoint resumes in any other (snapshot.conform wants every
        # key the live state has): `scaler` is a list of fp16's loss scaler state, empty in the other modes,
        # and conform checks a list item by item for the items the checkpoint has.
        return {"name": self.name, "reason": self.reason,
                "scaler": [self.scaler.state_dict()] if self.scaler is not None else []}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state["scaler"]:  # fp16 after fp16; a fresh scaler after another mode
            self.scaler.load_state_dict(state["scaler"][0])
        if state["name"] != self.name:
            from trainer.parallel.backend import is_main_process

            if is_main_process():
                fresh = (f"; fp16's loss scale starts over, at precision.init_scale={self.scaler.get_scale():g}"
                         if self.scaler is not None and not state["scaler"] else "")
                print(f"note: the checkpoint was trained in {state['name']} ({state['reason']}); "
                      f"this run uses {self.name} ({self.reason}){fresh}", flush=True)


class BF16(FP32):
    """bfloat16 autocast. Same exponent range as fp32, so no loss scaling is needed."""

    name = "bf16"
    dtype = torch.bfloat16

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)


class FP16(FP32):
    """float16 autocast with dynamic loss scaling (`torch.amp.GradScaler`).

    A step whose gradients overflowed is skipped by the scaler; `step()` then returns False so the
    trainer neither advances the LR schedule nor updates the EMA, and counts the skip.
    """

    name = "fp16"
    dtype = torch.float16

    skips_own_steps = True

    def __init__(self, device_type: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000,
                 reason: str | None = None, sharded: bool = False):
        super().__init__(device_type, reason, sharded)
        if device_type not in ("cuda", "cpu"):
            raise ConfigError(
                f"precision=fp16 is not supported on device type '{device_type}'. "
                "Use precision=bf16 or precision=fp32."
            )
        # (init_scale=0 made every loss 0 and stopped at the first step as "non-finite: lower optim.lr"; a negative
        # one or growth_interval=0 ran on with a scale that means nothing)
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not 0 < init_scale < float("inf"):
            raise ConfigError(f"precision.init_scale={init_scale!r} is invalid: the loss scale fp16 starts from must be "
                              "a number > 0 (the default, 65536.0, is GradScaler's; the scaler halves it at every "
                              "overflow and grows it after precision.growth_interval steps without one).")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ConfigError(f"precision.growth_interval={growth_interval!r} is invalid: expected an integer >= 1 "
                              "(the steps without an overflow after which the loss scale doubles; default 2000).")
        self.init_scale, self.growth_interval = init_scale, growth_interval
        # With sharded gradients an overflow shows in one rank's shard only: the overflow flag is reduced over
        # ranks, so every rank skips the same steps.
        scaler = _ShardedGradScaler if sharded else torch.amp.GradScaler
        self.scaler = scaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
        # GradScaler's update() ends an iteration: once after every optimizer of the step has stepped, never
        # between two (the second's gradients were scaled by the scale the first's overflow would halve). Which
        # step is a step's last only the loop knows, so the update waits for what comes next: a backward (the
        # next loss to scale) or a checkpoint's state_dict.
        self._update_due = False

    def _settle(self) -> None:
        if self._update_due:
            self._update_due = False
            self.scaler.update()

    def close_skipped_step(self) -> None:
        self._update_due = True  # (unscale_ recorded the overflow the update backs off for)

    def skip_was_routine(self) -> bool:
        # The scale after the pending update (a backoff); the scaler synced with the host to decide already.
        return self.scaler.get_scale() * self.scaler.get_backoff_factor() >= 1.0

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self._settle()
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per step (clipping and a user's own call may both ask; GradScaler refuses a second time)."""
        from torch.amp.grad_scaler import OptState

        self._settle_if_stepped(optimizer)
        if _has_grads(optimizer) and self.scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
            self.scaler.unscale_(optimizer)

    def _settle_if_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped again with no backward between (a loop that skipped a batch and still steps): the
        update the last step left due comes now, as a backward would have made it (GradScaler refuses a second step
        before it)."""
        from torch.amp.grad_scaler import OptState

        if self._update_due and self.scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.STEPPED:
            self._settle()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        self._settle_if_stepped(optimizer)
        if not _has_grads(optimizer):  # (no gradient to check or unscale: the optimizer skips every parameter)
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self._update_due = True
        # Whether it was applied: this optimizer's own overflow flags, which GradScaler.step already waited for
        # on the host to decide (reading them again waits for nothing new).
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        return not any(f.item() for f in found)

    def state_dict(self) -> dict:
        self._settle()  # (a checkpoint holds the scale the next step uses)
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._update_due = False
        super().load_state_dict(state)


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


class _ShardedGradScaler(torch.amp.GradScaler):
    """GradScaler whose overflow flag is the max over ranks. (torch's FSDP ShardedGradScaler does the same
    but keeps the flag as a 1-element tensor, which fused optimizers refuse next to their scalar steps.)"""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        from trainer.parallel.backend import all_reduce_max_

        super().unscale_(optimizer)
        for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            all_reduce_max_(found_inf)


# -- precision=auto ------------------------------------------------------------------------------------
AUTO_TARGET = "trainer.parallel.precision.auto"
MODES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}
# x86 flags of the units that compute bf16 (fp16) dot products; without them torch converts to fp32 and back.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
NATIVE_FP16_FLAGS = ("avx512_fp16", "amx_fp16")
CLEARLY_FASTER = 1.5  # bf16 / fp32 matmul throughput from which the probe counts bf16 as native


def choose(device_type: str, cuda_capability: tuple[int, int] | None = None, cpu_flags: Iterable[str] | None = None,
           probe: Callable[[], float] | None = None) -> tuple[str, str]:
    """The mode precision=auto picks, and why: bf16 where the device computes it natively, fp16 with loss
    scaling on CUDA GPUs older than compute capability 8.0, fp32 otherwise.

    `cuda_capability` is the GPU's (major, minor); `cpu_flags` the CPU's feature flags (None where they cannot
    be read); `probe()` says how many times faster bf16 matmuls run than fp32 ones on this CPU, and is called
    only when the flags do not show bf16 units. `_is_mkldnn_bf16_supported()` cannot decide: it is also
    true where bf16 is emulated (and 3-4x slower than fp32)."""
    if device_type == "cuda":
        major, minor = cuda_capability
        if (major, minor) >= (8, 0):
            return "bf16", f"this GPU (compute capability {major}.{minor}) computes bf16 natively"
        return "fp16", f"this GPU (compute capability {major}.{minor}) has no bf16 units; fp16 with loss scaling"
    if device_type != "cpu":
        return "fp32", f"no bf16 rule for device type '{device_type}'"
    flags = set(cpu_flags or ())
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return "bf16", f"this CPU has {' and '.join(found)}"
    lacks = "no avx512_bf16 or amx_bf16" if cpu_flags is not None else "CPU flags unknown"
    speedup = probe() if probe is not None else None
    if speedup is not None and speedup >= CLEARLY_FASTER:
        return "bf16", f"{lacks}, but bf16 matmuls ran {speedup:.1f}x as fast as fp32 here"
    measured = f", and bf16 matmuls ran {speedup:.2f}x as fast as fp32" if speedup is not None else ""
    return "fp32", f"no native bf16 on this CPU: {lacks}{measured}"


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags (Linux's /proc/cpuinfo: `flags` on x86, `Features` on ARM); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def matmul_speedup(dtype: torch.dtype, seconds: float = 0.015) -> float:
    """How many times faster one CPU thread multiplies 256 x 256 matrices in `dtype` than in fp32 (~2 x `seconds`):
    the ratio of their best throughputs over rounds that alternate the two, so a burst of load in one window
    does not decide it."""
    from trainer.parallel.hardware import best_matmul_tflops

    best = best_matmul_tflops((torch.float32, dtype), size=256, seconds=seconds)
    return best[dtype] / best[torch.float32]


def choose_for(device: str | torch.device) -> tuple[str, str]:
    """`choose` with this machine's capabilities for `device` (`world.device`; 'auto' is a GPU if there is one)."""
    from trainer.parallel.backend import usable_device

    device = usable_device(device) if isinstance(device, str) else device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose(device.type, capability, cpu_flags(), lambda: matmul_speedup(torch.bfloat16))


def auto(device_type: str = "cpu", sharded: bool = False) -> FP32:
    """`precision=auto` built as it stands (without `resolve_auto`): the mode `choose` picks on this machine."""
    name, why = choose_for(device_type)
    return MODES[name](device_type, reason=f"precision=auto: {why}", sharded=sharded)


def resolve_auto(cfg: DictConfig) -> tuple[DictConfig, str | None]:
    """`cfg` with `precision=auto` replaced by the mode it picks here (`precision._target_: trainer.parallel.precision.BF16`,
    and `precision.reason`), and the line that says so ("precision=auto: bf16 (this CPU has avx512_bf16)");
    `(cfg, None)` for any other precision. The device is `world.device`.

    Called once per job before any worker starts (the CLI's job function; `build` for a config that still
    says auto, on rank 0), so that every rank computes in the same mode and config.yaml records it."""
    node = cfg.get("precision")
    if not isinstance(node, DictConfig) or node.get("_target_") != AUTO_TARGET:
        return cfg, None
    name, why = choose_for(cfg.world.device)
    concrete = {"_target_": f"{__name__}.{MODES[name].__name__}"}
    if name == "fp16":  # its loss scaler's settings, as precision=fp16 has them
        from importlib.resources import files

        concrete = OmegaConf.to_container(OmegaConf.create((files("trainer.conf") / "precision" / "fp16.yaml").read_text()))
    resolved = copy.deepcopy(cfg)
    with open_dict(resolved):
        resolved.precision = {**concrete, "reason": f"precision=auto: {why}"}
    return resolved, f"precision=auto: {name} ({why})"


def emulation_note(node: DictConfig, device: torch.device) -> str | None:
    """One line when the config's mode is one this device only emulates (slower than fp32), else None."""
    target = node.get("_target_")
    if target == f"{__name__}.BF16" and device.type in ("cpu", "cuda"):
        native, why = choose_for(device)
        if native != "bf16":
            return f"note: precision=bf16 is emulated here ({why}), usually slower; precision=auto would choose {native}."
    if target == f"{__name__}.FP16" and device.type == "cpu" and not set(NATIVE_FP16_FLAGS) & set(cpu_flags() or ()):
        speedup = matmul_speedup(torch.float16)
        if speedup < 1:
            return (f"note: precision=fp16 is emulated on this CPU (fp16 matmuls ran {speedup:.2f}x as fast as fp32): "
                    "expect it several times slower than fp32; precision=auto picks the fastest mode here.")
    return None
