"""`python -m benchmarks --quick` runs the items and writes the markdown table and, beside it, the JSON data.

No timing is asserted: on a shared CPU any threshold would be flaky. `make bench` is where numbers count.
The multi-process items (ddp, fsdp, tp) and activation_checkpointing are left out here: their CLI runs and
hand-written jobs add ~60 s at quick sizes on 2 cores, and the suite's time is bounded; what they run is
the framework's DDP/FSDP/TP paths the other tests check. Run them by hand before changing them:
python -m benchmarks --quick --only ddp,fsdp,tp,activation_checkpointing --out /tmp/B.md
The start-up item times nine fresh interpreters (~20 s of the suite on 2 cores, a third of this file's time):
its own test below runs what it measures once each, in this process, and the two commands that must not import
torch for real.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, run_here

SMOKE_ITEMS = "loop_tiny,loop_default,bf16_vs_fp32,checkpoint"  # (see above)
CURVE = "## Quality per second: `make train`"
# A report's quality section as `--curve` writes it, with notes written by hand below its `Settings:` line.
OLD_CURVE = f"""{CURVE}

Validation bits per byte of the default `recipe=lm` run (old).

| step | tokens | train time | val/loss | val/bpb |
|---|---|---|---|---|
| 250 | 0.51 M | 29 s | 2.4481 | 3.5319 |

Settings: model 4 layers x 128 (old).

How the defaults were chosen: by hand.

| model | val/bpb |
|---|---|
| 4 x 128 | 2.11 |
"""


# A section written by hand, as a GPU run's record: `make bench` cannot regenerate it, so it must keep it.
GPU_NOTES = """## On a GPU (a run of its own)

Measured by hand: 42.2% MFU.

"""


@pytest.mark.slow  # starts several `python -m trainer` processes, DDP included
def test_quick_benchmark_writes_table_and_json(tmp_path):
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nan old table\n\n" + GPU_NOTES + OLD_CURVE)
    r = run_cli("--quick", "--only", SMOKE_ITEMS, "--out", str(out), module="benchmarks",
                timeout=300)  # run_cli puts the repo on the path
    assert r.returncode == 0, r.stderr
    text = out.read_text()

    for row in ("a. loop overhead, gpt_tiny", "a. loop overhead, gpt_small", "b. bf16 vs fp32",
                "d. safetensors save_file", "d. safetensors load_file + touch"):
        assert re.search(rf"^\| {re.escape(row)}.*\|$", text, flags=re.M), row
    # The rest is regenerated; every section (a GPU run's, the quality curve with its notes) is kept as it was.
    assert "an old table" not in text and text.endswith("\n" + GPU_NOTES + OLD_CURVE)

    # The raw data lives beside the markdown (BENCH.json), not in it.
    assert "```json" not in text and "per_round_ms" not in text and "`BENCH.json`" in text
    res = json.loads((tmp_path / "BENCH.json").read_text())
    assert set(res) == {"meta", "loop_tiny", "loop_default", "bf16_vs_fp32", "checkpoint"}
    assert res["meta"]["quick"] is True
    for key in ("loop_tiny", "loop_default"):
        assert {"trainer_ms_per_step", "plain_ms_per_step", "overhead_ms_per_step", "throughput_ratio",
                "per_round_ms", "target", "met"} <= set(res[key])
        assert res[key]["metrics_lines_written"] > 0  # the Trainer really logged to metrics.jsonl
    assert {"bf16_tokens_per_s", "fp32_tokens_per_s", "ratio"} <= set(res["bf16_vs_fp32"])
    assert {"bytes", "api", "ms", "format_save_ratio", "format_load_ratio"} <= set(res["checkpoint"])
    assert {"safetensors_save", "raw_write", "safetensors_load", "raw_read"} <= set(res["checkpoint"]["ms"])
    # Every figure is a finite positive number.
    for key in ("loop_tiny", "loop_default"):
        assert res[key]["trainer_ms_per_step"] > 0 and res[key]["plain_ms_per_step"] > 0


def test_the_start_up_item_times_what_it_names_and_help_and_cfg_job_import_no_torch(monkeypatch, tmp_path):
    """`make bench`'s start-up item (e.), each of its nine interpreters run once here instead of timed: the CLI run
    it times composes and trains, the plain script it compares with trains the same step, each baseline is the
    command its row names, and its table rows and JSON carry each figure where the row says. Whether --help and
    --cfg job import torch is measured for real (two interpreters without torch)."""
    import torch

    from benchmarks import startup
    from benchmarks.harness import Context

    ran: dict[str, list[str]] = {}
    figures = iter(range(1, 100))

    def timed(args):  # each baseline: what it runs recorded, a distinct figure returned
        ran[args[-1] if args[0] == "-c" else " ".join(args)] = args
        return float(next(figures))

    def first_step(args):  # the CLI run: composed and trained here, in this process, as the bench runs it
        r = run_here(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
        assert r.returncode == 0 and (tmp_path / "run" / "metrics.jsonl").stat().st_size > 0, r.stderr
        return 10.0, 11.0

    monkeypatch.setattr(startup, "python_first_line_seconds", timed)
    monkeypatch.setattr(startup, "python_seconds", timed)
    monkeypatch.setattr(startup, "first_step", first_step)
    ctx = Context(quick=True, data=("data=text", f"data.path={ROOT / 'README.md'}"), threads=1, default_model=())
    r = startup.measure(ctx, startup.STARTUP.quick)

    assert set(ran) == {"import torch; print('imported', flush=True)", "import torch, torch._dynamo; print('imported', "
                        "flush=True)", startup.PLAIN_FIRST_STEP, "-m trainer --help", "-m trainer --cfg job", "pass"}
    scope: dict = {}
    exec(startup.PLAIN_FIRST_STEP, scope)  # the plain twin trains one step (it prints its loss)
    assert torch.isfinite(scope["loss"])
    assert r["first_step_s"] == 10.0 and r["exit_s"] == 11.0
    assert r["first_step_minus_import_torch_s"] == 10.0 - r["import_torch_s"] and r["met"] is False
    assert r["help_imports_torch"] is False and r["cfg_job_imports_torch"] is False  # (measured)
    rows = startup.rows(r)
    for row in ("e. start-up to first step", "e. `python -m trainer --help`", "e. `python -m trainer --cfg job`"):
        assert any(re.fullmatch(rf"\| {re.escape(row)}.*\|", line) for line in rows), (row, rows)
    assert "| 10.00 s | `import torch` " in rows[0] and "no torch import | yes |" in rows[-1]


def test_curve_rewrites_only_its_generated_part(tmp_path):
    """`--curve RUN_DIR` replaces the curve and its settings; the table above and the notes below stay."""
    run = tmp_path / "run"
    run.mkdir()
    events = [{"step": 10, "train/step_time_ms": 100.0, "train/tokens_per_s": 2048.0},
              {"step": 10, "val/loss": 1.5, "val/bpb": 2.1640}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "run_info.json").write_text(json.dumps({"device": "cpu", "git_commit": "abcdef0123"}))
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nthe table\n\n" + OLD_CURVE)

    r = run_cli("--out", str(out), "--curve", str(run), module="benchmarks")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nthe table\n\n" + CURVE)
    assert "| 10 | 0.00 M | 1 s | 1.5000 | 2.1640 |" in text and "commit abcdef0" in text
    assert "(old)" not in text and "Settings: (config.yaml not found)" in text
    assert text.endswith("Settings: (config.yaml not found)\n\n" + OLD_CURVE.split("(old).\n\n")[-1])


def test_step_parts_times_every_swap_and_leaves_the_framework_as_it_was(capsys):
    """`python -m benchmarks.step_parts` swaps parts of the Trainer's step for the hand-written loop's by patching
    the Runtime's class and the noise module; each case gets its line, and nothing stays patched after it."""
    from benchmarks import step_parts
    from trainer import noise
    from trainer.loop.runtime import Runtime

    before = {name: getattr(Runtime, name) for name in ("accumulate", "backward", "clip_grad_norm_", "step")}
    for_samples = noise.for_samples
    assert step_parts.main(["--rounds", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("as is", *(f"{part} swapped" for part in step_parts.PARTS), "all swapped"):
        assert re.search(rf"^  {re.escape(label)} +[+-]\d+\.\d{{3}} ", out, flags=re.M), (label, out)
    assert {name: getattr(Runtime, name) for name in before} == before and noise.for_samples is for_samples


def test_a_quick_or_partial_bench_leaves_the_committed_report_alone():
    """`make bench ARGS='--quick --only ...'` replaced BENCHMARKS.md's table with its few tiny rows."""
    import benchmarks
    from benchmarks.__main__ import report_path

    everything = ",".join(benchmarks.ITEMS)
    assert report_path(None, False, everything, benchmarks.ITEMS, None) == Path("BENCHMARKS.md")
    for quick, only in ((True, everything), (False, "loop_tiny,checkpoint")):
        path = report_path(None, quick, only, benchmarks.ITEMS, None)
        assert path.name == "BENCHMARKS.md" and path.parent.name == "trainer-bench" and path.parent.is_absolute()
    assert report_path("mine.md", True, "ddp", benchmarks.ITEMS, None) == Path("mine.md")


def test_an_out_path_ending_in_json_is_refused_before_anything_runs(tmp_path, capsys):
    """`--out X.json`: the raw data goes to X.json, then the markdown report replaced it (the run's figures lost)."""
    from benchmarks.__main__ import main

    out = tmp_path / "mine.json"
    with pytest.raises(SystemExit) as e:
        main(["--only", "loop_tiny", "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert "--out names the markdown report" in capsys.readouterr().err


@pytest.mark.parametrize("compile", [None, "model"])
def test_the_plain_loop_runs_the_model_it_holds_now(compile):
    """The hand-written DDP baseline (benchmarks/ddp.py) wraps `loop.model` in DistributedDataParallel after building
    the loop. Its loss called the bare model captured at construction, so that "DDP" loop never all-reduced a
    gradient, and the framework's DDP was compared with a loop that skipped its communication."""
    import torch

    from benchmarks.harness import COMMON, TINY, compose
    from benchmarks.loop import PlainLoop
    from trainer import build_data

    cfg = compose([*COMMON, *TINY, "precision=fp32", "trainer.max_steps=2", "trainer.compile=true",
                   "trainer.compile_backend=eager"])  # (the backend PlainLoop's compile="model" uses)
    train, _ = build_data(cfg.data)
    loop = PlainLoop(cfg, train, torch.device("cpu"), bf16=False, compile=compile)  # (compiled: dynamo, no codegen)

    class Wrapper(torch.nn.Module):  # what DistributedDataParallel is to the loop: a module around the model
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, x):
            self.calls += 1
            return self.inner(x)

    loop.model = Wrapper(loop.model)
    loop.run(2)
    assert loop.model.calls == 2
