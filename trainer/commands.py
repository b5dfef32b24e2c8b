"""`python -m trainer env` (what is installed and available) and `python -m trainer check`
(a correctness self-test of this machine: accumulation, DDP, FSDP, tensor parallelism and resume)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def env(argv: list[str]) -> int:
    """Print versions, devices and backends, then the default config (like `accelerate env`)."""
    import torch
    import torch.distributed as dist

    from .backend import available_cores
    from .precision import choose_for, cpu_flags

    flags = cpu_flags()
    relevant = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile", "avx512f", "avx2", "bf16")

    rows = [
        ("trainer", _version("trainer")),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
        *[(p, _version(p)) for p in ("torch", "hydra-core", "omegaconf", "wandb", "safetensors", "tqdm")],
        ("CPU cores available", str(available_cores())),
        ("torch threads (intra-op / inter-op)", f"{torch.get_num_threads()} / {torch.get_num_interop_threads()}"),
        ("CUDA available", str(torch.cuda.is_available())),
    ]
    if torch.cuda.is_available():
        rows += [("CUDA / cuDNN", f"{torch.version.cuda} / {torch.backends.cudnn.version()}")]
        rows += [(f"GPU {i}", torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
        rows += [("bf16 on GPU", str(torch.cuda.is_bf16_supported()))]
    rows += [
        ("torch.distributed", str(dist.is_available())),
        ("gloo / nccl", f"{dist.is_gloo_available()} / {dist.is_nccl_available()}"),
        ("MKL / oneDNN (CPU bf16 matmuls)", f"{torch.backends.mkl.is_available()} / {torch.backends.mkldnn.is_available()}"),
        ("CPU flags (bf16/fp16 units)", "unknown (no /proc/cpuinfo)" if flags is None else
         " ".join(f for f in relevant if f in flags) or "none of " + " ".join(relevant)),
        ("WANDB_MODE", os.environ.get("WANDB_MODE", "(unset)")),
        ("wandb credentials", "yes" if os.environ.get("WANDB_API_KEY") else "not in the environment"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"- {k.ljust(width)} : {v}" for k, v in rows))
    name, why = choose_for("auto")
    print(f"\nprecision=auto would choose: {name} ({why})")
    print("\nDefault config (python -m trainer --cfg job):\n")
    from omegaconf import OmegaConf

    from .composition import compose

    print(OmegaConf.to_yaml(compose(argv)))
    return 0


# -- check ---------------------------------------------------------------------------------------
CHECK_SETTINGS = ["debug=smoke", "data=text", "trainer.max_steps=12", "trainer.eval_samples=37",
                  "checkpoint.every_n_steps=6"]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]


def _compare(name: str, got: list[float], want: list[float], tol: float) -> bool:
    if len(got) != len(want):
        print(f"FAIL  {name}: {len(got)} logged steps, expected {len(want)}")
        return False
    diff = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    ok = diff <= tol
    print(f"{'OK  ' if ok else 'FAIL'}  {name}: max |loss difference| = {diff:.2e} (tolerance {tol:.0e})", flush=True)
    return ok


def check(argv: list[str]) -> int:
    """Train a tiny model several ways that must agree, and say which agree. Exit 0 if all do."""
    import contextlib
    import io
    import shutil

    import torch

    from . import compose, train
    from .backend import available_cores

    tmp = Path(tempfile.mkdtemp(prefix="trainer-check-"))
    try:
        corpus = tmp / "corpus.txt"
        corpus.write_bytes(Path(json.__file__).read_bytes() + Path(subprocess.__file__).read_bytes())
        os.environ.setdefault("TRAINER_CACHE_DIR", str(tmp / "cache"))
        base = [*CHECK_SETTINGS, f"data.path={corpus}", *argv]
        # GPU kernels are not bitwise deterministic; on the CPU everything here is.
        tol_equiv, tol_exact = (1e-3, 1e-3) if torch.cuda.is_available() else (1e-5, 0.0)

        def run_here(name: str, *extra: str) -> Path:
            run_dir = tmp / name
            with contextlib.redirect_stdout(io.StringIO()):  # the inner runs' own summary lines
                train(compose([*base, *extra]), run_dir)
            return run_dir

        def run_procs(name: str, *extra: str) -> tuple[Path, str | None]:
            r = subprocess.run([sys.executable, "-m", "trainer", *base, *extra, f"hydra.run.dir={tmp / name}"],
                               capture_output=True, text=True)
            return tmp / name, (r.stderr.strip() or f"exit code {r.returncode}") if r.returncode else None

        print(f"trainer check: tiny GPT, 12 steps, in {tmp} (removed afterwards)", flush=True)
        ref = _losses(run_here("big", "data.batch_size=8"))
        results = [_compare("accumulation 2 x 4 equals batch 8",
                            _losses(run_here("acc", "data.batch_size=4", "trainer.grad_accum_steps=2")), ref, tol_equiv)]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Tensor parallelism on 4 processes (fsdp 2 x tp 2) where there are 4 cores or GPUs, else tp 2 alone.
        four = (torch.cuda.device_count() if torch.cuda.is_available() else available_cores()) >= 4
        tp = ["world=fsdp", "world.nproc_per_node=4", "world.tp=2", "data.batch_size=4"] if four else \
             ["world=ddp", "world.nproc_per_node=2", "world.tp=2", "data.batch_size=8"]
        runs = [(f"2 ranks ({backend}, ddp) x batch 4 equals 1 rank x batch 8", "ddp",
                 ["world=ddp", "world.nproc_per_node=2", "data.batch_size=4"]),
                (f"2 ranks ({backend}, fsdp) x batch 4 equals 1 rank x batch 8", "fsdp",
                 ["world=fsdp", "world.nproc_per_node=2", "data.batch_size=4"]),
                (f"tensor parallel 2 ({backend}{', x fsdp 2' if four else ''}) equals 1 rank x batch 8", "tp", tp)]
        for label, name, args in runs:
            run_dir, failed = run_procs(name, *args)
            if failed:
                print(f"FAIL  {label}: the run failed:\n{failed}")
                results.append(False)
            else:
                results.append(_compare(label, _losses(run_dir), ref, tol_equiv))
        resumed = run_here("resumed", "data.batch_size=8", f"resume={tmp / 'big' / 'checkpoints' / 'step_00000006'}")
        results.append(_compare("save at step 6, resume: steps 7-12 continue the loss stream", _losses(resumed),
                                ref[6:], tol_exact))
        print(f"\n{sum(results)} passed, {len(results) - sum(results)} failed")
        return 0 if all(results) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
