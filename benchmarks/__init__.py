"""Benchmarks of `trainer` where every figure is a ratio against plain PyTorch, measured side by side in one run.

    make bench                                         # the full suite: BENCHMARKS.md and BENCHMARKS.json (~5 min, 2 cores)
    python -m benchmarks --quick --out /tmp/B.md       # tiny sizes in seconds (the smoke test); data in /tmp/B.json
    python -m benchmarks --only loop_tiny,startup
    python -m benchmarks --curve RUN_DIR               # the quality-per-second section, from a `make train` run

Repository tooling, not part of the installed package: run it from the checkout, whose `trainer` it
measures. A shared machine drifts, so nothing is compared with a number from another run: each item
runs the framework and its plain-PyTorch baseline in alternating rounds (A B, then B A, ...) and
reports the median of the per-round figures (differences and ratios are taken per round, then the
median). In-process loops are timed by the wall clock and in process CPU time; on the CPU with one
thread the CPU time decides, as it is the less disturbed by other jobs.

    loop_tiny, loop_default  Trainer.fit() vs a hand-written loop: same model, AdamW groups, batches,
                             clipping, autocast and LR schedule (gpt_tiny 4x32, gpt_small 8x256, bf16);
                             the plain loop runs in turns between windows of the Trainer's steps  (loop.py)
    bf16_vs_fp32             tokens/s of the plain loop on the default lm model in each precision  (loop.py)
    ddp                      `python -m trainer world=ddp` 2 processes x 1 thread vs 1 x 1 (train/tokens_per_s),
                             and the same pair for a hand-written DDP loop (what the machine allows)  (ddp.py)
    checkpoint               safetensors and trainer.checkpoint save/read vs writing/reading the same bytes raw
                             (checkpoint.py)
    startup                  `python -m trainer` to its first optimizer step vs `python -c "import torch"`, vs
                             `import torch, torch._dynamo` (every torch.optim optimizer imports it) and vs
                             a plain script doing the same step; whether --help / --cfg job import torch  (startup.py)
    fsdp                     bytes of params + grads + AdamW state one rank holds under world=fsdp vs world=ddp
                             (2 processes, after a step); `python -m trainer world=fsdp` 2 x 1 thread vs a
                             hand-written FSDP2 loop (fully_shard per Block, then the root) and vs world=ddp  (fsdp.py)
    tp                       `python -m trainer world=ddp world.tp=2` (2 x 1 thread, one data-parallel rank) vs a
                             hand-written loop (parallelize_module with the model's _tp_plan) and vs one
                             process; on CUDA with 2 GPUs also gpt_medium  (tp.py)
    activation_checkpointing `python -m trainer trainer.activation_checkpointing=true` vs without: peak memory
                             and tokens/s (1 process, gpt_small on a 32x256 batch)  (activations.py)
    anchors                  the same loop on trainer.Runtime, Accelerate's Accelerator and Lightning Fabric beside
                             the hand-written one: 1 process, DDP 2 and FSDP 2 (fp32, 1 thread each); needs the
                             bench extra (accelerate, lightning), which the framework never imports  (anchors.py)
    deepspeed                bytes one rank holds under world=deepspeed ZeRO-2 and ZeRO-3 next to world=ddp and
                             world=fsdp (2 processes, in a step); `python -m trainer world=deepspeed world.stage=2|3`
                             2 x 1 thread vs a plain DeepSpeed script (engine.backward / engine.step), fp32; needs
                             the deepspeed extra  (deepspeed_bench.py)
    device_map               big-model inference: trainer.load(..., device_map=...) on the CPU, CPU + disk and all
                             on disk vs Accelerate's cpu_offload, dispatch_model and disk_offload, a GPT 4x the
                             memory cap, each configuration in its own process (tokens/s, peak RSS, bytes read per
                             token, logits bitwise); needs the bench extra for Accelerate's side  (device_map_bench.py)
    data                     a text corpus of several GB generated under /tmp, streamed (data=text_stream): the loader
                             alone over all of it (tokens/s, samples/s, RSS sampled: first batch / peak / end), with
                             2 loader workers (one stream, by_file), next to `python -m trainer` training on it
                             (tokens/s of the step, the process's RSS polled) and on one small file  (data_bench.py)
    pp                       pipeline parallelism: `world.pp=2` (1F1B) against a hand-written torch.distributed.pipelining
                             loop on the same model, and one process; the bubble each schedule leaves (measured: 1 - T1 /
                             (2 x Tpp)); parameter and AdamW bytes per stage  (pp.py)

An item is a module with an `Item` (harness.py: how it measures, its rows of the table, its sizes in a
full and a quick run) and one line in ITEMS below.
"""

from .activations import ACTIVATIONS
from .anchors import ANCHORS
from .checkpoint import CHECKPOINT
from .data_bench import DATA
from .ddp import DDP
from .deepspeed_bench import DEEPSPEED
from .device_map_bench import DEVICE_MAP
from .fsdp import FSDP
from .harness import Item
from .loop import BF16_VS_FP32, LOOP_DEFAULT, LOOP_TINY
from .pp import PP
from .startup import STARTUP
from .tp import TP

# The suite, in the order it runs and its rows appear in the table. Names are the JSON keys.
ITEMS: dict[str, Item] = {
    "loop_tiny": LOOP_TINY,
    "loop_default": LOOP_DEFAULT,
    "bf16_vs_fp32": BF16_VS_FP32,
    "ddp": DDP,
    "checkpoint": CHECKPOINT,
    "startup": STARTUP,
    "fsdp": FSDP,
    "tp": TP,
    "activation_checkpointing": ACTIVATIONS,
    "anchors": ANCHORS,
    "deepspeed": DEEPSPEED,
    "device_map": DEVICE_MAP,
    "data": DATA,
    "pp": PP,
}
