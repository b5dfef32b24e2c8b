"""The lm recipe as a loop of your own, on trainer.Runtime (the README's "Your own loop" section).

    python -m trainer launch recipes/lm/own_loop.py --data FILE                      # one process
    python -m trainer launch world=ddp world.nproc_per_node=2 recipes/lm/own_loop.py --data FILE
    torchrun --nproc_per_node 2 recipes/lm/own_loop.py --data FILE --world ddp

It trains what `python -m trainer recipe=lm model=gpt_tiny data=text data.path=FILE` trains, step for step
(the same batches, initial weights, optimizer and schedule), and writes the final weights to --out.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import trainer
from trainer.loop.schedule import cosine
from trainer.recipes.lm.data import text_file
from trainer.recipes.lm.model import GPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a text file (or a directory / glob of them)")
    p.add_argument("--world", default=None, help="single, ddp or fsdp (default: the launcher's world=, else single)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="per process and micro-step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="own_loop_out", help="where the final weights and checkpoints go")
    p.add_argument("--save-every", type=int, default=0, help="save_state every N steps (0: never)")
    args = p.parse_args()

    # world, precision, trainer.grad_accum_steps and trainer.seed come from `python -m trainer launch KEY=VALUE`.
    # Metrics go to OUT/metrics.jsonl (and the trackers of logger=... under launch).
    rt = trainer.Runtime(args.world, run_dir=args.out) if args.world else trainer.Runtime(run_dir=args.out)
    train, _ = text_file(args.data, seq_len=args.seq_len)

    # The same initial weights on every rank (setup also sends rank 0's to all before sharding).
    torch.manual_seed(rt.seed)
    model = GPT(vocab_size=256, seq_len=args.seq_len, n_layer=1, n_head=2, d_model=64, dropout=0.0)
    torch.manual_seed(rt.seed)
    model.init_weights()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scheduler = cosine(optimizer, total_steps=args.steps, warmup_steps=args.warmup)

    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(train, batch_size=args.batch_size)
    rt.register("scheduler", scheduler)
    step = rt.load_state(f"{args.out}/checkpoints") or 0  # resume where a killed run stopped
    if step:
        rt.print(f"resumed from {args.out}/checkpoints at step {step}" + (
            f" (already at --steps {args.steps}: nothing to train; another --out starts a new run)"
            if step >= args.steps else ""))

    step_loss = 0.0
    while step < args.steps:
        for batch in loader:
            x, y = batch
            with rt.accumulate(model):
                with rt.autocast():
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
                rt.backward(loss)
            step_loss += loss.detach() / rt.grad_accum_steps
            if not rt.sync_gradients:
                continue  # the next micro-batch of this step
            rt.clip_grad_norm_(model, 1.0)
            rt.step(optimizer, scheduler)
            step += 1
            rt.log({"train/loss": rt.reduce(step_loss).item()}, step)  # the mean over the global batch
            step_loss = 0.0
            if args.save_every and step % args.save_every == 0:
                rt.save_state(f"{args.out}/checkpoints", step)
            if step == args.steps:
                break

    rt.save_model(model, args.out)
    rt.print(f"done: {step} steps; weights in {args.out}/model.safetensors")
    rt.end()


if __name__ == "__main__":
    main()
