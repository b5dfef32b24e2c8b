"""Reading a rank's part of a pretrained tensor (trainer/models/pretrained.py `read_part`): the box of the whole tensor,
read without ever holding the whole tensor of a split layer."""

from __future__ import annotations

import torch

from trainer.checkpoint import tensorfile
from trainer.models.pretrained import read_part


class CountingReader:
    """A FileReader that remembers the size of each read."""

    def __init__(self, reader: tensorfile.FileReader):
        self.reader, self.reads = reader, []

    def read(self, begin: int, end: int) -> torch.Tensor:
        self.reads.append(end - begin)
        return self.reader.read(begin, end)

    def tensor(self, entry):
        return self.reader.tensor(entry)


def test_each_box_is_the_slice_of_the_whole_and_no_read_holds_the_whole(tmp_path):
    whole = {"w": torch.randn(12, 10, generator=torch.Generator().manual_seed(0)),
             "e": torch.arange(2 * 6 * 4, dtype=torch.int32).reshape(2, 6, 4), "s": torch.tensor(3.0)}
    tensorfile.write(tmp_path / "m.safetensors", whole)
    reader, _, entries = tensorfile.map_safetensors(tmp_path / "m.safetensors")
    boxes = {  # (shape, offset): FSDP's rows, tensor parallelism's columns (rowwise), both, a 3-D middle cut
        "w": [((6, 10), (6, 0)), ((12, 5), (0, 5)), ((3, 5), (3, 0)), ((12, 3), (0, 7)), ((0, 10), (12, 0))],
        "e": [((2, 3, 4), (0, 3, 0)), ((1, 6, 2), (1, 0, 2))],
        "s": [((), ())],
    }
    try:
        for key, cases in boxes.items():
            entry, t = entries[key], whole[key]
            for shape, offset in cases:
                counting = CountingReader(reader)
                got = read_part(counting, entry, shape, offset)
                want = t[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                assert got.dtype == t.dtype and torch.equal(got, want), (key, shape, offset)
                if t.dim():
                    row = t[0].numel() * t.element_size()
                    box = max(got.numel() * t.element_size(), row)
                    assert all(n <= box for n in counting.reads), (key, shape, offset, counting.reads)
    finally:
        reader._file.close()


def test_a_config_mismatch_names_the_other_name_of_a_setting():
    """GPT2Config's max_position_embeddings is n_positions: the advice `++model.n_positions=64` was then refused as a
    second value of the setting the run's config gave as model.max_position_embeddings."""
    from trainer.models.pretrained import _other_names

    class Like:  # (a transformers config class's attribute_map: other name -> the config's own)
        attribute_map = {"max_position_embeddings": "n_positions", "hidden_size": "n_embd"}

    said = _other_names(Like, {"n_positions": (64, 32), "n_layer": (2, 1)})
    assert said == ("; where your model config names a setting otherwise, set that key instead "
                    "(model.max_position_embeddings for model.n_positions)")
    assert _other_names(Like, {"n_layer": (2, 1)}) == ""
