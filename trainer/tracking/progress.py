"""Progress display for the main process: a tqdm bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys

SHORT = {"tokens": "tok"}


def _fmt(metrics: dict[str, float], unit: str = "tokens") -> str:
    rate = f"train/{unit}_per_s"
    parts = [f"{k.split('/')[1]}={metrics[k]:.3g}" for k in ("train/loss", "train/lr", "train/grad_norm") if k in metrics]
    if rate in metrics:
        parts.append(f"{SHORT.get(unit, unit)}/s={metrics[rate]:,.0f}")
    return " ".join(parts)


class Progress:
    def __init__(self, total: int, initial: int = 0, mode: str = "auto", unit: str = "tokens"):
        self.unit = unit
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.total, self.bar = mode, total, None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")

    def update(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """Called every step (tqdm redraws at most every 0.1 s, so this costs microseconds), with the metrics
        at log steps: they are set before the step is counted, so a redraw shows this log step's values."""
        if self.bar is not None:
            if metrics:
                self.bar.set_postfix_str(_fmt(metrics, self.unit), refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.mode == "lines" and metrics:
            print(f"step {step}/{self.total} {_fmt(metrics, self.unit)}", flush=True)

    def write(self, text: str, always: bool = False) -> None:
        """A line beside the progress (metrics of an eval, a sample); `always`: also with trainer.progress=off
        (why a run stopped early)."""
        if self.mode == "off" and not always:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NullProgress(Progress):
    """What non-main ranks get: shows nothing."""

    def __init__(self, *args, **kwargs):
        self.mode, self.bar = "off", None

    def update(self, step, metrics=None):
        pass
