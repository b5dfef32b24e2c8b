"""What happens to an optimizer step whose gradient norm is NaN or inf (`trainer.nonfinite`).

Deciding on the host means reading the norm every step: `.item()`, which on a GPU waits for the
whole step to finish and lets the device run dry while Python prepares the next one. So there are
two ways to check, chosen by `trainer.nonfinite_check`:

- `step`: read the norm every step. Exact for both policies; free on the CPU, where nothing runs
  ahead of Python. `nonfinite=skip` always uses it: whether a skipped step advances the LR schedule
  and the EMA is a host decision.
- `log`: no host read between log steps. A device-side latch turns on at the first non-finite norm
  and is handed to the fused optimizer as `found_inf` (the way `torch.amp.GradScaler` skips steps),
  so that update and every later one are skipped on the device. The host reads the latch at the
  next log step, eval or checkpoint, and stops there naming the first bad step: the weights are
  those before it, exactly as with `step`, and nothing after it was saved. Needs `nonfinite=stop`
  and an optimizer that takes `found_inf` (`fused=True` Adam, AdamW, SGD, Adagrad).

`auto` picks `log` on accelerators when it applies, `step` otherwise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from trainer.errors import ConfigError, NonFiniteError

FIX = "Lower optim.lr, clip gradients (trainer.grad_clip, or a lower value of it), use precision=bf16/fp32, or set trainer.nonfinite=skip."
# Under trainer.nonfinite=skip already (the run stopped after max_nonfinite_skips in a row): what is left to try.
FIX_SKIPPING = ("Lower optim.lr, clip gradients (trainer.grad_clip, or a lower value of it), use precision=bf16/fp32, or raise "
                "trainer.max_nonfinite_skips.")


def _found(norm: float, loss: torch.Tensor | None) -> tuple[str, str]:
    """What was non-finite, and a note: this rank's loss itself where it was (a sample or the loss function may then
    be the cause, which no learning rate fixes), else the gradient norm. Read only once the norm is known bad."""
    try:
        value = float(loss) if loss is not None else 0.0
    except (TypeError, ValueError, RuntimeError):  # (a loss that is no scalar here: the stop must still be this one)
        value = 0.0
    if math.isfinite(value):
        return f"non-finite gradient norm ({norm})", ""
    return (f"non-finite loss ({value})", "A sample of the batch or the loss function can make a NaN/inf loss, as "
            "can weights that diverged. ")


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` tensor (torch sets this flag for fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def resolve_check(check: str, policy: str, precision: str, optimizer: torch.optim.Optimizer,
                  device: torch.device) -> str:
    """`step` or `log` for `trainer.nonfinite_check`; a ConfigError when `log` is asked for but cannot work."""
    why_not = None
    if policy != "stop":
        why_not = "trainer.nonfinite=skip (whether a skipped step advances the LR schedule is decided on the host)"
    elif precision == "fp16":
        why_not = "precision=fp16 (its loss scaler decides on the host whether each step is applied)"
    elif not supports_found_inf(optimizer):
        why_not = f"{type(optimizer).__name__} without fused=true (only fused optimizers can skip a step on the device)"
    if check == "log" and why_not:
        raise ConfigError(f"trainer.nonfinite_check=log does not work with {why_not}. "
                          "Use trainer.nonfinite_check=auto or step.")
    if check == "auto":
        return "step" if why_not or device.type == "cpu" else "log"
    return check


class NonFiniteGuard:
    """Decides whether an optimizer step's update is applied when its gradient norm may be NaN/inf.

    The Trainer's step reads::

        if guard.allows(grad_norm, step):          # `step` mode: reads the norm; `log` mode: latches it
            with guard.skip_on_device(optimizer):  # `log` mode: a latched NaN skips the fused update
                applied = precision.step(optimizer)
        guard.record(applied, step)                # counts consecutive skips (fp16's too), stops after too many
    """

    @classmethod
    def build(cls, config, precision, optimizer: torch.optim.Optimizer, backend) -> NonFiniteGuard:
        """From the `trainer` config section (`nonfinite`, `nonfinite_check`, `max_nonfinite_skips`)."""
        check = resolve_check(config.nonfinite_check, config.nonfinite, precision.name, optimizer, backend.device)
        return cls(config.nonfinite, check, config.max_nonfinite_skips, backend, precision=precision)

    def __init__(self, policy: str, check: str, max_skips: int, backend, precision=None):
        if check not in ("step", "log"):
            raise ValueError(f"check must be 'step' or 'log' (resolve 'auto' with resolve_check), not {check!r}")
        self.policy, self.check, self.max_skips, self.backend = policy, check, max_skips, backend
        # A mode that skips steps itself (fp16's loss scaler) is asked how, never reached into.
        self.precision = precision if precision is not None and precision.skips_own_steps else None
        self._loss_skip = False  # this step was refused for a NaN/inf loss (fp16 with nonfinite=skip)
        self.consecutive_skips = 0
        # `log` mode: on the device, 1.0 from the first non-finite norm on (the value fused kernels test for);
        # on the host, the (step, norm) pairs latched since the last read, which name the first bad step then.
        self.found_inf = torch.zeros((), dtype=torch.float32, device=backend.device)
        self._one = torch.ones((), dtype=torch.float32, device=backend.device)
        self._latched: list[tuple[int, torch.Tensor]] = []
        self.unread = False  # steps latched since the last read

    def allows(self, grad_norm: torch.Tensor, step: int, loss: torch.Tensor | None = None) -> bool:
        """Whether optimizer step number `step` may apply its update. `step` mode reads the norm (grads are
        synced, so every rank sees the same one) and stops or skips on NaN/inf; `log` mode latches it on
        the device and says yes: the skip then happens inside the optimizer (`skip_on_device`).

        With fp16 the loss scaler skips steps whose *gradients* overflowed (routine); a NaN/inf *loss* is
        not an overflow of the scaling, so it is judged like a NaN gradient elsewhere (the scaler already
        reads the host every step, so this read costs nothing more)."""
        if self.precision is not None:
            if loss is None:
                return True
            # Every rank must decide alike: the min over ranks of "my loss is finite".
            finite = float(self.backend.all_reduce(torch.isfinite(loss.detach()).float(), op="min"))
            if finite:
                return True
            if self.policy == "stop":
                raise NonFiniteError(f"non-finite loss ({loss.item()}) at step {step} on rank {self.backend.rank} (or "
                                     f"another rank); the update was not applied and any earlier checkpoint is intact. {FIX}")
            self.precision.close_skipped_step()  # (unscale_ ran) without stepping
            self._loss_skip = True  # not an overflow of the scaling: it counts toward max_skips
            return False
        if self.check == "log":
            self._latch(grad_norm, step)
            return True
        norm = grad_norm.item()
        if math.isfinite(norm):
            return True
        if self.policy == "stop":
            found, note = _found(norm, loss)
            raise NonFiniteError(f"{found} at step {step} on rank {self.backend.rank}; the update was not applied and "
                                 f"any earlier checkpoint is intact. {note}{FIX}")
        return False

    def skip_on_device(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """`log` mode: hand the latch to the fused optimizer as `found_inf`, the protocol torch.amp.GradScaler
        uses, so a non-finite step (and every later one) leaves parameters and moments untouched."""
        if self.check != "log":
            return contextlib.nullcontext()
        return self._handed(optimizer)

    @contextlib.contextmanager
    def _handed(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        optimizer.grad_scale, optimizer.found_inf = None, self.found_inf
        try:
            yield
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def record(self, applied: bool, step: int) -> None:
        """Count a skipped update; stop after `max_skips` in a row. fp16's loss scaler skips an overflowed step
        and halves its scale: routine while the scale is above 1, but an overflow at a scale of 1 or less
        means the gradients themselves are NaN/inf, and those count."""
        loss_skip, self._loss_skip = self._loss_skip, False
        if not applied and not loss_skip and self.precision is not None and self.precision.skip_was_routine():
            return
        self.consecutive_skips = 0 if applied else self.consecutive_skips + 1
        if self.consecutive_skips >= self.max_skips:
            raise NonFiniteError(f"{self.consecutive_skips} consecutive non-finite steps up to step {step}, each one "
                                 f"skipped (trainer.max_nonfinite_skips={self.max_skips}); stopping. {FIX_SKIPPING}")

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_skips = int(state.get("consecutive_skips", 0))

    def _latch(self, grad_norm: torch.Tensor, step: int) -> None:
        """One kernel a step (a GPU runs ahead of the host, and small models are launch-bound): GradScaler's own
        check sets found_inf to 1 if the norm is NaN/inf, and multiplies it by 1.0, which leaves it as it was.
        The norm is kept, unread, for the message; reads come at every log step, so the list stays short."""
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else torch.as_tensor(grad_norm)
        norm = norm.detach().to(device=self.found_inf.device, dtype=torch.float32)  # (no copy when it is already)
        torch._amp_foreach_non_finite_check_and_unscale_([norm], self.found_inf, self._one)
        self._latched.append((step, norm))
        self.unread = True

    def read(self, step: int) -> None:
        """`log` mode, at step `step`: read the latch (one host sync) and stop if a step since the last read
        was non-finite. Every rank reads at the same steps and takes the max over ranks, so all stop together."""
        if not self.unread:
            return
        self.unread = False
        latched, self._latched = self._latched, []
        found = self.backend.all_reduce(self.found_inf, op="max")
        if not float(found):
            return
        local = float(self.found_inf)
        self.found_inf.zero_()  # a caller that catches the error and goes on trains normally again
        if not local:
            raise NonFiniteError(f"another rank hit a non-finite gradient norm by step {step} (rank "
                                 f"{self.backend.rank}'s gradients were finite); its updates were skipped on the "
                                 f"device and any earlier checkpoint is intact. {FIX}")
        norms = torch.stack([n for _, n in latched]).tolist() if latched else []
        bad_step, norm = next(((s, v) for (s, _), v in zip(latched, norms) if not math.isfinite(v)),
                              (step, float("nan")))
        bad_step = int(bad_step)
        raise NonFiniteError(
            f"non-finite gradient norm ({norm}) at step {bad_step} on rank {self.backend.rank}; that update and "
            f"the {step - bad_step} after it (up to this check at step {step}) were skipped on the device, so "
            f"the weights are those before step {bad_step}, and any earlier checkpoint is intact. {FIX}"
        )
