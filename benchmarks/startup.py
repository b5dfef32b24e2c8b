"""e. Start-up: `python -m trainer` to its first optimizer step vs `python -c "import torch"`, vs
`import torch, torch._dynamo` (every torch.optim optimizer imports it) and vs a plain script doing the
same step; whether --help / --cfg job import torch. The CLI is timed to its first metrics line, each baseline to a
line it prints (not to its exit: that would add the interpreter's shutdown to the baselines alone)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import (
    COMMON,
    ROOT,
    TINY,
    Context,
    Item,
    alternate,
    check,
    cli_env,
    compose,
    median,
    met_cell,
    no_checkpoints,
    python_first_line_seconds,
    python_seconds,
)


def first_step(args: list[str]) -> tuple[float, float]:
    """(seconds to the first metrics.jsonl line, i.e. the first optimizer step with log_every=1; seconds to exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-start-"))
    metrics = tmp / "metrics.jsonl"
    try:
        with open(tmp / "stderr.txt", "w+") as err:
            t0 = time.perf_counter()
            p = subprocess.Popen([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={tmp}"], cwd=ROOT, env=cli_env(),
                                 stdout=subprocess.DEVNULL, stderr=err)
            first = None
            while p.poll() is None:
                if first is None and metrics.exists() and metrics.stat().st_size > 0:
                    first = time.perf_counter() - t0
                time.sleep(0.002)
            done = time.perf_counter() - t0
            if p.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"python -m trainer {' '.join(args)} failed:\n{err.read()[-3000:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (first if first is not None else done), done


def imports_torch(args: list[str]) -> bool:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                       text=True)
    check(r, "python -X importtime -m trainer " + " ".join(args))
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in r.stderr.splitlines())


# The plain-PyTorch twin of a start-up run: the same model, optimizer groups and one bf16 step, by hand.
# Building any torch.optim optimizer imports torch._dynamo (1-2 s here), so a plain script pays it too.
PLAIN_FIRST_STEP = """
import torch, torch.nn.functional as F
from trainer.recipes.lm.model import GPT
torch.manual_seed(0)
model = GPT(vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=64)
params = list(model.parameters())
opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=2e-3)
x, y = torch.randint(256, (4, 32)), torch.randint(256, (4, 32))
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
loss.backward()
torch.nn.utils.clip_grad_norm_(params, 1.0)
opt.step()
print(loss.item(), flush=True)  # timed to this line, as the CLI is to its first metrics line
"""


def measure(ctx: Context, sizes: dict) -> dict:
    rounds = sizes["startup_rounds"]
    run = [*COMMON, *ctx.data, *TINY, "trainer.max_steps=1", "trainer.log_every=1", "trainer.eval_samples=1"]
    run += no_checkpoints(compose(run))
    if sizes["startup_warmup"]:  # one untimed run first (dataset cache, .pyc files, page cache)
        first_step(run)
    firsts, exits = [], []

    def trainer_run() -> float:
        f, d = first_step(run)
        firsts.append(f)
        exits.append(d)
        return f

    # The baselines are timed to a line they print, as the CLI is to its first metrics line: to their exit, they
    # also counted the interpreter's and torch's shutdown (0.3-0.45 s here), which the CLI's figure leaves out.
    imported = "print('imported', flush=True)"
    t = alternate({"import_torch": lambda: python_first_line_seconds(["-c", f"import torch; {imported}"]),
                   "trainer": trainer_run,
                   "import_torch_dynamo": lambda: python_first_line_seconds(["-c", f"import torch, torch._dynamo; {imported}"]),
                   "plain_script": lambda: python_first_line_seconds(["-c", PLAIN_FIRST_STEP]),
                   "help": lambda: python_seconds(["-m", "trainer", "--help"]),
                   "cfg_job": lambda: python_seconds(["-m", "trainer", "--cfg", "job"]),
                   "python": lambda: python_seconds(["-c", "pass"])}, rounds)
    extra = median([f - b for f, b in zip(firsts, t["import_torch"])])
    return {
        "command": "python -m trainer " + " ".join(run), "rounds": rounds,
        "python_s": median(t["python"]), "import_torch_s": median(t["import_torch"]),
        "plain_script_first_step_s": median(t["plain_script"]),
        "first_step_s": median(firsts), "exit_s": median(exits), "first_step_minus_import_torch_s": extra,
        "first_step_minus_plain_script_s": median([f - b for f, b in zip(firsts, t["plain_script"])]),
        "import_torch_dynamo_s": median(t["import_torch_dynamo"]),
        "first_step_minus_import_torch_dynamo_s": median([f - b for f, b in zip(firsts, t["import_torch_dynamo"])]),
        "help_s": median(t["help"]), "cfg_job_s": median(t["cfg_job"]),
        "help_imports_torch": imports_torch(["--help"]), "cfg_job_imports_torch": imports_torch(["--cfg", "job"]),
        "target": "<= 1 s", "met": bool(extra <= 1.0),
    }


def rows(r: dict) -> list[str]:
    out = [f"| e. start-up to first step, gpt_tiny | {r['first_step_s']:.2f} s | `import torch` "
           f"{r['import_torch_s']:.2f} s | {r['first_step_minus_import_torch_s']:+.2f} s | {r['target']} | "
           f"{met_cell(r['met'])} |",
           f"| e. start-up to first step vs the floor of any torch.optim user | {r['first_step_s']:.2f} s | "
           f"`import torch, torch._dynamo` {r['import_torch_dynamo_s']:.2f} s | "
           f"{r['first_step_minus_import_torch_dynamo_s']:+.2f} s | — | — |",
           f"| e. start-up to first step vs a plain script doing the same step | {r['first_step_s']:.2f} s | "
           f"plain script {r['plain_script_first_step_s']:.2f} s | {r['first_step_minus_plain_script_s']:+.2f} s "
           f"| — | — |"]
    for k, flag in (("help", "--help"), ("cfg_job", "--cfg job")):
        imports = "imports torch" if r[f"{k}_imports_torch"] else "no torch import"
        out.append(f"| e. `python -m trainer {flag}` | {r[f'{k}_s']:.2f} s | `import torch` "
                   f"{r['import_torch_s']:.2f} s | {r[f'{k}_s'] - r['import_torch_s']:+.2f} s, {imports} | "
                   f"no torch import | {met_cell(not r[f'{k}_imports_torch'])} |")
    return out


STARTUP = Item(measure, rows, full={"startup_rounds": 5, "startup_warmup": True},
               quick={"startup_rounds": 1, "startup_warmup": False})
