"""Every command and code block in the README works as written (issue 16.2), so the README cannot drift.

`test_readme_walkthrough` follows the README top to bottom in one fresh directory, as a new user would:
each single-process command runs through the real CLI (`trainer.entry.cli.main`, in this process to save an
interpreter's start-up per command), with only its length shrunk (`debug=smoke` appended where the README
trains for minutes); the Python blocks run; the YAML block is written where its first line says. Commands
that need several processes, machines or services are composed and checked exactly as the CLI does before
it runs anything (`trainer.entry.cli.precheck`: config groups, keys, types, ranges, imports of every
`_target_`), and the test that runs the same command for real is named in `CHECKED_ONLY`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
from pathlib import Path

import torch
from conftest import ROOT, load_weights, read_metrics, run_here, series

README = ROOT / "README.md"

# Commands the walkthrough composes and checks but does not run here, and where the same thing runs.
CHECKED_ONLY = {
    "world.nnodes=2": "two machines; tests/test_distributed.py runs two nodes on this one",
    "world.nproc_per_node=2": "two processes; tests/test_distributed.py and test_finished.py run DDP on 2 ranks",
    "world.nproc_per_node=4": "four processes; tests/test_parallel.py runs dp 2 x tp 2",
    "torchrun": "torchrun; tests/test_distributed.py runs the same command under torchrun",
    "hydra/launcher=submitit_slurm": "a SLURM cluster; tests/test_slurm.py runs the same sweep with submitit_local",
    "logger=wandb": "wandb's service (seconds to start); tests/test_wandb.py runs it offline and reads its files",
}
# `make` targets are the CI's and the measurements' own commands: .ci/run runs `make test`, and
# BENCHMARKS.md records `make bench` and `make train`. `source .venv/bin/activate` is the shell's setup:
# test_the_quickstart_runs_from_a_fresh_shell runs it in a new shell, as a user would.
NOT_RUN = ("make ", "source ")
# Where the README trains for minutes, the walkthrough trains for steps.
SHRINK = {"trainer.max_steps=50": "trainer.max_steps=5", "trainer.max_steps=200": "trainer.max_steps=5",
          "trainer.max_steps=300": "trainer.max_steps=5", "tune.memory_mb=4000": "tune.memory_mb=4000 tune.max_batch_size=64"}


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced block of `lang`."""
    found, current, start = [], None, 0
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if current is None and line.strip() == f"```{lang}":
            current, start = [], n + 1
        elif current is not None and line.strip() == "```":
            found.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return found


def commands() -> list[tuple[int, str]]:
    """Every command line of the bash blocks: continuations joined, comments dropped."""
    out = []
    for start, text in blocks("bash"):
        pending, first = "", 0
        for n, line in enumerate(text.splitlines(), start):
            line = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not pending:
                first = n
            if line.endswith("\\"):
                pending += line[:-1]
                continue
            line = (pending + line).strip()
            pending = ""
            if line:
                out.append((first, " ".join(line.split())))
    return out


def test_the_readme_has_what_the_walkthrough_expects():
    """The extraction itself: if these fail, the walkthrough below would silently test less."""
    cmds = [c for _, c in commands()]
    assert len(cmds) >= 25 and all(c.startswith(("python -m trainer", "torchrun", "PYTHONPATH=", "make ", "source "))
                                   for c in cmds), cmds
    assert any("\\" in t for _, t in blocks("bash"))  # the SLURM sweep's continuation lines were joined
    assert len(blocks("python")) == 7 and len(blocks("yaml")) == 1


def precheck(args: list[str], cwd: Path) -> None:
    """What the CLI checks before it runs anything, without running: a mistake raises UserError."""
    from trainer.entry.cli import precheck as check

    old = os.getcwd()
    os.chdir(cwd)
    try:
        if args[0] == "eval":  # trainer/entry/commands.py's evaluate up to its launch
            from trainer.config.compose import prepare
            from trainer.entry.commands import _run_and_options
            from trainer.inference.finished import checkpoint_of, config_of

            run_dir, opts, overrides = _run_and_options(args[1:], "eval", ("checkpoint",))
            checkpoint_of(run_dir, opts.get("checkpoint", "latest"))
            prepare(config_of(run_dir, overrides))
        else:
            flags = [a for a in args if a in ("-m", "--multirun")][:1]
            with _as_on_a_slurm_login_node(cwd):  # (submitit_slurm is refused where there is no sbatch, srun)
                check(flags + [a for a in args if a not in ("-m", "--multirun")])
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _as_on_a_slurm_login_node(scratch: Path):
    """PATH with an `sbatch` and an `srun` that are never run: what the checks see on a cluster's login node."""
    bin_dir = scratch / ".slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("sbatch", "srun"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old


def test_readme_walkthrough(tmp_path):
    home = tmp_path / "project"
    home.mkdir()
    (home / "README.md").write_bytes(README.read_bytes())  # `data.path=README.md`
    places = {"$SCRATCH": str(tmp_path / "scratch"), "/shared/run1": str(tmp_path / "shared" / "run1")}
    finished: list[str] = []  # run dirs, for RUN_DIR

    def run_dir_of(result) -> str:
        found = re.findall(r"^done: (.+)$", result.stdout, re.M)
        assert found, result.stdout + result.stderr
        return found[-1]

    # The files of "Your own model": the Python block as mymodels.py, the YAML block where its comment says.
    (line_py, model_code), = [b for b in blocks("python") if b[1].startswith("# mymodels.py")]
    (home / "mymodels.py").write_text(model_code)
    (_, recipe), = blocks("yaml")
    target = re.search(r"^# (conf/\S+\.yaml)", recipe, re.M)
    assert target, "the README's recipe block no longer says where it goes"
    (home / target.group(1)).parent.mkdir(parents=True)
    (home / target.group(1)).write_text(recipe)

    sys.path.insert(0, str(home))  # PYTHONPATH=. (only that command needs it; harmless for the others)
    try:
        for line, command in commands():
            where = f"README.md line {line}: {command}"
            if command.startswith(NOT_RUN):
                continue
            for placeholder, value in places.items():
                command = command.replace(placeholder, value)
            if "RUN_DIR" in command or "outputs/DATE/TIME" in command:
                assert finished, f"{where}: no run has finished before this line"
                command = command.replace("RUN_DIR", finished[0]).replace("outputs/DATE/TIME", finished[-1])
            for old, new in SHRINK.items():
                command = command.replace(old, new)
            words = shlex.split(command)
            args = words[words.index("trainer") + 1:] if "trainer" in words else []
            assert args or command.endswith("trainer"), f"{where}: not a trainer command"

            if args[:1] == ["tune"]:  # the finders, on the smoke model; on several processes checked as tune does
                if any(key in command for key in CHECKED_ONLY):
                    from trainer.entry.tuning import prepare

                    prepare([*args[1:], "debug=smoke"])  # test_user_pitfalls.py runs the finders on 2 ranks
                    continue
                r = run_here(*args, "debug=smoke", cwd=home)
                assert r.returncode == 0 and "Run with: python -m trainer" in r.stdout, f"{where}\n{r.stdout}\n{r.stderr}"
                continue
            if args[:1] == ["launch"]:  # a script of your own (recipes/lm/own_loop.py): shorter, from the repository
                args = [str(ROOT / a) if a.endswith(".py") else a for a in args]
                if any(key in command for key in CHECKED_ONLY):  # several processes: test_own_loop.py runs them
                    from trainer.entry.commands import launch_parts

                    launch_parts(args[1:])  # the overrides composed and checked, the script found
                    continue
                r = run_here(*args, "--steps", "3", "--out", str(tmp_path / "own_loop"), cwd=home)
                assert r.returncode == 0 and (tmp_path / "own_loop" / "model.safetensors").is_file(), \
                    f"{where}\n{r.stdout}\n{r.stderr}"
                continue
            if args[:1] == ["config"]:  # this machine's defaults: saved in a throwaway config home, not the suite's
                r = run_here(*args, cwd=home, env={"TRAINER_CONFIG_HOME": str(tmp_path / "machine")})
                # (a /scratch this user cannot make here is saved with a note: the file may serve a cluster's nodes)
                stderr = [ln for ln in r.stderr.splitlines() if not ln.startswith("note: runs cannot be written to")]
                assert r.returncode == 0 and r.stdout.strip() and not stderr, f"{where}\n{r.stdout}\n{r.stderr}"
                continue
            skip = [why for key, why in CHECKED_ONLY.items() if key in command]
            if skip:
                precheck(args, home)  # raises on any mistake the CLI would refuse
                continue
            if args[:1] in (["eval"], ["sample"]):
                r = run_here(*args, cwd=home)
                assert r.returncode == 0, f"{where}\n{r.stdout}\n{r.stderr}"
                # (sample on a debug=smoke lm run, which asks for no text, says how to ask for it)
                said = r.stdout.strip() or "task.sample_tokens=" in r.stderr
                assert ("val/loss" in r.stdout) if args[0] == "eval" else said, f"{where}\n{r.stdout}\n{r.stderr}"
                continue
            if "--help" in args or "--cfg" in args:
                r = run_here(*args, cwd=home)
                assert r.returncode == 0 and r.stdout.strip() and not r.stderr, f"{where}\n{r.stderr}"
                continue
            if "debug=smoke" not in args and "recipe=regress" not in args:
                args.append("debug=smoke")  # the README's minutes, as seconds
            if not any(a.startswith("hydra.run.dir=") for a in args) and "-m" not in args:
                # The default dir has the second in its name: two runs in one second would share it.
                args.append(f"hydra.run.dir=outputs/line{line}")
            r = run_here(*args, cwd=home)
            assert r.returncode == 0, f"{where}\n{r.stdout}\n{r.stderr}"
            assert "Traceback" not in r.stderr, f"{where}\n{r.stderr}"
            if "-m" not in args:
                finished.append(run_dir_of(r))
    finally:
        sys.path.remove(str(home))
        sys.modules.pop("mymodels", None)

    # Python blocks: the loading example runs on a finished run with EMA weights (diffusion's); the _tp_plan
    # excerpt is the model's own.
    (_, loading), = [b for b in blocks("python") if "ema=True" in b[1]]  # (Fine-tuning's: tests/test_hf.py)
    scope: dict = {}
    exec(loading.replace("RUN_DIR", next(d for d in finished if (Path(d) / "model_ema.safetensors").is_file())), scope)
    assert isinstance(scope["model"], torch.nn.Module) and not scope["model"].training
    assert isinstance(scope["ema_model"], torch.nn.Module)
    # The final checkpoint's EMA weights are the export's.
    assert all(torch.equal(v, scope["ema_model"].state_dict()[k]) for k, v in scope["latest"].state_dict().items())
    (_, excerpt), = [b for b in blocks("python") if "_tp_plan" in b[1]]
    from trainer.recipes.lm.model import GPT

    plan = eval(re.search(r"_tp_plan = (\{.*?\})", excerpt, re.S).group(1))
    assert plan == GPT._tp_plan, "the README's _tp_plan is not the lm model's"
    (_, excerpt), = [b for b in blocks("python") if "_pp_plan" in b[1]]
    plan = eval(re.search(r"_pp_plan = (\{.*?\})$", excerpt, re.S | re.M).group(1))
    assert plan == GPT._pp_plan, "the README's _pp_plan is not the lm model's"

    # What the commands promise: the resume trio continued runs/a, the regression recipe learned.
    assert (home / "runs" / "a" / "checkpoints").is_dir()
    regress = Path(next(d for d in finished if "mymodels" in (Path(d) / "config.yaml").read_text()))
    events = read_metrics(regress)
    assert series(events, "val/loss")[-1] < 0.01 * series(events, "train/loss")[0]
    assert set(load_weights(regress / "model.safetensors")) == {"fc.weight", "fc.bias"}


def section_blocks(title: str, lang: str = "bash") -> list[tuple[int, str]]:
    """The fenced `lang` blocks of the README section `## title` (up to the next `## ` heading)."""
    lines = README.read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((n for n in range(start, len(lines)) if lines[n].startswith("## ")), len(lines))
    return [(n, text) for n, text in blocks(lang) if start < n <= end]


def fresh_shell(script: str, cwd: Path, home: Path):
    """`script` in a new non-login bash, as a new terminal has it: no activated venv, no PYTHONPATH."""
    import subprocess

    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "TRAINER_CACHE_DIR": os.environ["TRAINER_CACHE_DIR"], "WANDB_MODE": "offline"}
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_quickstart_runs_from_a_fresh_shell(tmp_path):
    """Issue 32.1: the quickstart's commands need .venv's Python, and a new shell does not have it. The
    quickstart's own setup line (after `make venv`, which `make test` has run) must be all it takes; the
    `trainer` console script needs none."""
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        import pytest

        pytest.skip("no .venv in the checkout (make venv creates it; CI's make test does)")
    (_, quickstart), *_ = section_blocks("Quickstart")
    setup = [line.split(" #")[0].strip() for line in quickstart.splitlines() if line.startswith("source ")]
    assert setup == ["source .venv/bin/activate"], "the quickstart no longer says how to get .venv's python"
    first = next(c for _, c in commands() if c.startswith("python -m trainer debug=smoke"))
    run_dir = tmp_path / "run"
    r = fresh_shell(f"{setup[0]} && cd {shlex.quote(str(tmp_path))} && {first} hydra.run.dir={run_dir}",
                    cwd=ROOT, home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (run_dir / "model.safetensors").is_file()
    # Without activating: the console script the README names.
    assert ".venv/bin/trainer" in README.read_text()
    r = fresh_shell(".venv/bin/trainer --cfg job debug=smoke optim.lr=1e-3", cwd=ROOT, home=tmp_path)
    assert r.returncode == 0 and "lr: 0.001" in r.stdout and not r.stderr, r.stdout + r.stderr


def test_the_accelerate_table_is_what_the_cli_answers(tmp_path):
    """Issue 32.3: each flag of "Coming from Accelerate", given to the CLI, is refused (exit 2, one line) with
    exactly the overrides the table names beside it, and those overrides make a command the CLI takes."""
    lines = README.read_text().split("## Coming from Accelerate", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| `--")]
    assert len(rows) >= 12
    for flag_cell, _, here_cell, _ in rows:
        flags, here = shlex.split(flag_cell.strip("`")), shlex.split(here_cell.strip("`"))
        r = run_here(*flags, "debug=smoke", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (flags, r.stderr)
        proposed = shlex.split(r.stderr.split("The same run: ", 1)[1])
        assert proposed == ["python", "-m", "trainer", *here, "debug=smoke"], (flags, r.stderr)
        precheck([*here, "debug=smoke"], tmp_path)
    assert not (tmp_path / "outputs").exists()
