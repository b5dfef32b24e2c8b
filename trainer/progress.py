"""Progress display for the main process: a tqdm bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys


def _fmt(metrics: dict[str, float]) -> str:
    keys = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s")
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            parts.append(f"{k.split('/')[1]}={v:.3g}" if k != "train/tokens_per_s" else f"tok/s={v:,.0f}")
    return " ".join(parts)


class Progress:
    def __init__(self, total: int, initial: int = 0, mode: str = "auto"):
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
                self.bar.set_postfix_str(_fmt(metrics), refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.mode == "lines" and metrics:
            print(f"step {step}/{self.total} {_fmt(metrics)}", flush=True)

    def write(self, text: str) -> None:
        if self.mode == "off":
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
