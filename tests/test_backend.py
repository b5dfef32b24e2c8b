"""The rank helpers recipes use: main_process_first, is_main_process, barrier, with 2 gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import start_processes


def _worker(rank: int, world: int, store: str, log: str) -> None:
    import torch.distributed as dist

    from trainer.parallel.backend import barrier, is_main_process, main_process_first

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with main_process_first():
            cache = Path(log).with_suffix(".cache")
            existed = cache.exists()
            if not existed:
                cache.write_text("built")
            with open(log, "a") as f:
                f.write(f"{rank} main={is_main_process()} cache_existed={existed}\n")
        barrier()
    finally:
        dist.destroy_process_group()


def test_main_process_first_runs_rank_0_then_the_others(tmp_path):
    log = tmp_path / "log.txt"
    start_processes(_worker, (2, str(tmp_path / "store"), str(log)), nprocs=2)
    assert log.read_text().splitlines() == ["0 main=True cache_existed=False", "1 main=False cache_existed=True"]


def test_a_cpu_run_on_a_gpu_machine_joins_a_gloo_only_group(monkeypatch):
    """world.device=cpu where there are GPUs (two CPU processes on a one-GPU machine): no NCCL part in its process
    group, so no collective of it can pick a GPU that is not its own. A GPU run gets both."""
    import torch

    from trainer.parallel.backend import default_pg_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_pg_backend(torch.device("cpu")) == "gloo"
    assert default_pg_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert default_pg_backend() == "cpu:gloo,cuda:nccl"  # before the device is known: whatever the machine has


def test_map_tensors_keeps_a_batch_s_structure_and_leaves_what_is_not_a_tensor():
    """What Backend.to_device walks: dicts, lists, tuples and named tuples (which take their
    fields as arguments, so rebuilding one from a generator would fail), each tensor mapped, the rest as it was."""
    from collections import namedtuple

    import torch

    from trainer.parallel.backend import map_tensors

    Pair = namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1), "text"]), "ids": (torch.tensor([3]), 7)}
    out = map_tensors(lambda t: t + 1, batch)
    assert type(out["pair"]) is Pair and type(out["pair"].y) is list and type(out["ids"]) is tuple
    assert out["pair"].x.tolist() == [2.0, 2.0] and out["pair"].y[0].tolist() == [1.0]
    assert out["pair"].y[1] == "text" and out["ids"][0].tolist() == [4] and out["ids"][1] == 7
    # A mapping keeps its type (a Hugging Face BatchEncoding is a UserDict: it stayed on the CPU before).
    from collections import OrderedDict, UserDict

    class Encoding(UserDict):
        pass

    out = map_tensors(lambda t: t * 2, Encoding(input_ids=torch.ones(2), rest=OrderedDict(a=torch.ones(1))))
    assert type(out) is Encoding and type(out["rest"]) is OrderedDict
    assert out["input_ids"].tolist() == [2.0, 2.0] and out["rest"]["a"].tolist() == [2.0]


def test_the_cuda_loader_pins_a_batch_type_of_the_user_s_by_its_own_pin_memory(monkeypatch):
    """With data.num_workers=0 on CUDA the training loader cuts batches in the process and pins them as a
    DataLoader's pin_memory=True does: tensors at any depth, and a batch object of the user's through its own
    pin_memory() (which the DataLoader calls; a tensor walk alone left such a batch pageable). The pinning is faked
    here (no CUDA needed: the loader only asks the device's type), so the test runs on every machine."""
    import torch

    from trainer.data.sampling import train_loader

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())

    class Batch:  # e.g. a dataclass-like batch with tensors inside and its own pinning
        def __init__(self, x):
            self.x = x

        def pin_memory(self):
            return Batch(self.x.pin_memory())

    data = [i for i in range(6)]
    collate = {"custom": lambda rows: Batch(torch.tensor(rows)),
               "nested": lambda rows: {"ids": (torch.tensor(rows), "text")}}
    for name, fn in collate.items():
        dataset = type("Rows", (list,), {"collate_fn": staticmethod(fn)})(data)
        pinned.clear()
        batches = list(train_loader(dataset, [[0, 1], [2, 3]], 0, torch.device("cuda"), 0))
        assert len(pinned) == 2, name  # one tensor per batch, each pinned once
        got = [b.x for b in batches] if name == "custom" else [b["ids"][0] for b in batches]
        assert [t.tolist() for t in got] == [[0, 1], [2, 3]] and all(t is not p for t, p in zip(got, pinned))
        if name == "nested":
            assert all(b["ids"][1] == "text" for b in batches)
    # On the CPU nothing is pinned.
    pinned.clear()
    list(train_loader(dataset, [[0, 1]], 0, torch.device("cpu"), 0))
    assert pinned == []
