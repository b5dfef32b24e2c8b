"""The "Quality per second: make train" section of the report: val bits per byte against training time.

`python -m benchmarks --curve RUN_DIR` (re)writes it from a finished `make train` run; a full
`make bench` keeps it from the previous report. Notes written by hand below the generated part of the
section (after its `Settings:` line) survive both.
"""

from __future__ import annotations

import json
from pathlib import Path

CURVE_HEADING = "## Quality per second: `make train`"
SETTINGS = "Settings: "  # the generated part of the section ends with this line


def curve_section(run_dir: Path) -> list[str]:
    """Markdown for the val bits-per-byte curve of a finished `make train` run (its metrics.jsonl)."""
    run_dir = Path(run_dir)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    info = json.loads((run_dir / "run_info.json").read_text()) if (run_dir / "run_info.json").exists() else {}
    last_step, seconds, tokens, rows = 0, 0.0, 0.0, []
    for e in events:
        if "train/step_time_ms" in e:  # one window of (step - last_step) steps
            window = e["step"] - last_step
            seconds += window * e["train/step_time_ms"] / 1000
            tokens += window * e["train/step_time_ms"] / 1000 * e["train/tokens_per_s"]
            last_step = e["step"]
        if "val/bpb" in e:
            rows.append(f"| {e['step']} | {tokens / 1e6:.2f} M | {seconds:.0f} s | {e['val/loss']:.4f} | {e['val/bpb']:.4f} |")
    return [
        CURVE_HEADING,
        "",
        f"Validation bits per byte of the default `recipe=lm` run (`make train`: {info.get('device', 'cpu')}, "
        f"commit {str(info.get('git_commit'))[:7]}), against training time (eval and start-up excluded). "
        "Refresh with `python -m benchmarks --curve RUN_DIR` after `make train`.",
        "",
        "| step | tokens | train time | val/loss | val/bpb |",
        "|---|---|---|---|---|",
        *rows,
        "",
        SETTINGS + _settings(run_dir / "config.yaml"),
        "",
    ]


def _settings(cfg: Path) -> str:
    if not cfg.exists():
        return "(config.yaml not found)"
    import yaml

    c = yaml.safe_load(cfg.read_text())
    m, d, t, o = c["model"], c["data"], c["trainer"], c["optim"]
    return (f"model {m['n_layer']} layers x {m['d_model']} ({m['n_head']} heads), batch {d['batch_size']} x "
            f"{d['seq_len']} bytes, {t['max_steps']} steps, AdamW lr {o['lr']} with {c['scheduler']['warmup_steps']} "
            f"warmup steps then cosine to {c['scheduler'].get('min_lr_ratio', 1)} x lr, "
            f"precision {c['precision']['_target_'].rsplit('.', 1)[-1]}.")


def kept_curve(path: Path) -> list[str]:
    """The quality section of an existing report, whole: `make bench` regenerates the rest, not this."""
    if not path.exists() or CURVE_HEADING not in path.read_text():
        return []
    text = path.read_text()
    return text[text.index(CURVE_HEADING):].rstrip("\n").split("\n") + [""]


def hand_written(section: list[str]) -> list[str]:
    """The lines of a quality section below its generated part: after the `Settings:` line (or, in a
    section without one, after the curve's table); all of it but the heading if it has neither."""
    end = next((i + 1 for i, ln in enumerate(section) if ln.startswith(SETTINGS)), None)
    if end is None:
        table = [i for i, ln in enumerate(section) if ln.startswith("|")]
        end = next((i for i in range(table[0], len(section)) if not section[i].startswith("|")), len(section)) \
            if table else 1
    rest = section[end:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    while rest and not rest[-1].strip():
        rest = rest[:-1]
    return [*rest, ""] if rest else []


def write_curve(out: Path, run_dir: Path) -> None:
    """Replace the generated part of the quality section of `out` (the rest of the file is kept)."""
    text = out.read_text() if out.exists() else "# Benchmarks\n\n"
    head, section = (text[: text.index(CURVE_HEADING)], kept_curve(out)) if CURVE_HEADING in text else (text, [])
    out.write_text(head.rstrip("\n") + "\n\n" + "\n".join([*curve_section(run_dir), *hand_written(section)]))
