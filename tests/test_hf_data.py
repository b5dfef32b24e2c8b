"""Hugging Face `datasets` files and a `tokenizers` tokenizer.json (data=hf_text, trainer/data/hf_data.py; the hf-data
extra): tokenised once into a memmap keyed by the data's and the tokenizer's fingerprints, the same tokens from every
file format (and data=text's bytes without a tokenizer), the lm recipe's task training on them unchanged, and bad
input as one paragraph naming file and line, with no cache left half-written. The tokenizer is trained here, on the
tests' corpus, with the tokenizers library itself (nothing is downloaded). Without the extra, only the install
error's test runs."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, compose_cfg, read_metrics, run_here, series

EOS = "<|endoftext|>"
VOCAB = 300


@pytest.fixture(scope="module")
def files(corpus, tmp_path_factory) -> dict:
    """docs.jsonl (the corpus's paragraphs, one JSON object a line), and tokenizer.json (byte-level BPE, 300 ids)."""
    pytest.importorskip("datasets")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("hf_data")
    docs = [d for d in corpus.read_text().split("\n\n") if d.strip()]
    with open(root / "docs.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainer=trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return {"root": root, "jsonl": root / "docs.jsonl", "tokenizer": root / "tokenizer.json", "docs": docs,
            "tok": tok}


def hf(files, *extra: str) -> list[str]:
    return [*TINY, "data=hf_text", f"data.path={files['jsonl']}", f"data.tokenizer={files['tokenizer']}",
            f'data.eos_token="{EOS}"', f"model.vocab_size={VOCAB}", "task.sample_tokens=0",
            f"data.cache_dir={files['root'] / 'cache'}", *extra]


def build(overrides: list[str]):
    from trainer.entry.run import build_data

    return build_data(compose_cfg(overrides).data)


def test_a_tokenizer_run_trains_the_lm_task_on_the_tokenizers_ids(files, tmp_path):
    r = run_here(*hf(files, "trainer.max_steps=30", "trainer.eval_every=30"), f"hydra.run.dir={tmp_path}",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    val = series(read_metrics(tmp_path), "val/loss")
    # An untrained model guesses about uniformly over the 300 ids (ln 300 = 5.70 nats); 30 steps learn at least
    # the ids' frequencies (a unigram model of these tokens: 2.96 nats; measured after 30 steps: 4.24).
    assert len(val) == 1 and val[0] < math.log(VOCAB) - 0.5, val
    train, val_split = build(hf(files))
    # The packed stream is the documents' ids in order, each followed by the end-of-document token.
    tok, eos = files["tok"], files["tok"].token_to_id(EOS)
    ids = lambda d: [*tok.encode(d, add_special_tokens=False).ids, eos]  # noqa: E731
    expected = [t for d in files["docs"][:3] for t in ids(d)]
    assert train.tokens[: len(expected)].tolist() == expected and train.tokens.dtype.itemsize == 2
    x, y = train[1]
    assert x.tolist() == expected[32:64] and y.tolist() == expected[33:65]
    # The val split is the last 5% of the documents.
    n_val = int(len(files["docs"]) * 0.05)
    assert n_val >= 2 and val_split.tokens.tolist() == [t for d in files["docs"][-n_val:] for t in ids(d)]


def test_a_few_documents_still_give_a_val_split_or_say_why_not(files, tmp_path, capsys):
    """5% of 10 documents rounded down to none: the run had no val split (no val/loss) and said nothing. A val
    fraction of two or more documents is at least one; one too short for a window is said."""
    tok, eos = files["tok"], files["tok"].token_to_id(EOS)
    docs = sorted(files["docs"], key=len)[-10:]  # (each longer than a window)
    with open(tmp_path / "ten.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    _, val = build(hf(files, f"data.path={tmp_path / 'ten.jsonl'}"))
    assert val is not None and val.tokens.tolist() == [*tok.encode(docs[-1], add_special_tokens=False).ids, eos]
    with open(tmp_path / "short.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in (docs[-1], "tiny"))
    capsys.readouterr()
    _, val = build(hf(files, f"data.path={tmp_path / 'short.jsonl'}"))
    assert val is None and "the run has no val split (no val/loss)" in capsys.readouterr().out


def test_without_a_tokenizer_the_tokens_are_data_texts_bytes(files, tmp_path):
    text = "".join(d + "\n" for d in files["docs"])
    (tmp_path / "docs.txt").write_text(text)
    plain, _ = build([*TINY, "data=text", f"data.path={tmp_path / 'docs.txt'}", "data.val_fraction=0",
                      f"data.cache_dir={tmp_path}"])
    for path in ("docs.txt", str(files["jsonl"])):  # a text file: lines with their breaks; jsonl: the documents
        train, val = build(hf(files, f"data.path={tmp_path / path}", "data.tokenizer=null", "data.eos_token=null",
                              "model.vocab_size=256", "data.val_fraction=0"))
        assert val is None and train.tokens.dtype.itemsize == 1
        want = plain.tokens.numpy() if path == "docs.txt" else np.frombuffer("".join(files["docs"]).encode(), np.uint8)
        assert np.array_equal(train.tokens.numpy(), want), path


def test_tokenised_once_and_rebuilt_when_the_data_or_the_tokenizer_changes(files, monkeypatch, tmp_path):
    from trainer.data import hf_data

    data = tmp_path / "docs.jsonl"
    data.write_bytes(files["jsonl"].read_bytes())
    args = hf(files, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}")
    first, _ = build(args)

    with monkeypatch.context() as m:
        m.setattr(hf_data.Encoder, "encode", lambda *a: pytest.fail("tokenised again"))
        m.setitem(sys.modules, "datasets", None)  # a built cache is read without datasets
        again, _ = build(args)
    assert again.path == first.path
    spec = json.loads(files["tokenizer"].read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]  # one merge fewer: another tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    other, _ = build([*args, f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    assert other.path != first.path and not np.array_equal(other.tokens.numpy(), first.tokens.numpy())
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    more, val = build(args)
    tail = [*files["tok"].encode("one more document", add_special_tokens=False).ids,
            files["tok"].token_to_id(EOS)]
    assert more.path != first.path and val.tokens[-len(tail):].tolist() == tail
    assert sorted(p.name.startswith("hf-docs-") for p in (tmp_path / "cache").iterdir()) == [True] * 3
    # What a resume and an eval check the data against: the training tokens' sha256. The same text at another path
    # is the same data; a word edited in place (same size) is not (it resumed silently on the new text).
    import hashlib

    assert first.fingerprint == hashlib.sha256(first.tokens.numpy().tobytes()).hexdigest()
    # A cache built before the digest was recorded gets it at its next use, without tokenising again.
    meta_file = Path(more.path).parent / "meta.json"  # (args read the data with the document appended)
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if not k.endswith("_sha256")}))
    with monkeypatch.context() as m:
        m.setattr(hf_data.Encoder, "encode", lambda *a: pytest.fail("tokenised again"))
        assert build(args)[0].fingerprint == more.fingerprint
    assert json.loads(meta_file.read_text()) == meta
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "docs.jsonl").write_bytes(files["jsonl"].read_bytes())
    copied, _ = build([*args, f"data.path={tmp_path / 'elsewhere' / 'docs.jsonl'}"])
    assert copied.path != first.path and copied.fingerprint == first.fingerprint
    text = data.read_text()
    word = next(w for w in files["docs"][0].split() if w.isalpha() and w != w.upper())  # (in the first document)
    data.write_text(text.replace(word, word.upper(), 1))
    edited, _ = build(args)
    assert len(edited) == len(more) and edited.fingerprint != more.fingerprint


def test_a_build_killed_before_it_finished_leaves_nothing_once_the_next_build_ran(files, tmp_path):
    """A SIGKILLed tokenisation left its hidden temp dir (an Arrow copy of the corpus) for good: the next build, under
    its own pid, neither reused nor removed it. Only this host's dirs of dead processes go."""
    import shutil
    import socket
    import subprocess

    args = hf(files, f"data.cache_dir={tmp_path / 'cache'}")
    cache = Path(build(args)[0].path).parent
    shutil.rmtree(cache)  # (as if the build never finished)
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname().replace(".", "_")
    orphan, alive, elsewhere = (cache.parent / f".{cache.name}.{h}.{pid}.tmp" for h, pid in
                                ((host, dead.pid), (host, os.getppid()), ("otherhost", dead.pid)))
    for d in (orphan, alive, elsewhere):
        (d / "arrow").mkdir(parents=True)
    assert Path(build(args)[0].path).parent == cache
    assert not orphan.exists() and alive.exists() and elsewhere.exists()


def test_every_source_format_gives_the_same_tokens_offline(files, tmp_path, monkeypatch):
    import os

    import datasets

    ds = datasets.Dataset.from_list([{"text": d, "id": i} for i, d in enumerate(files["docs"])])
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    ds.to_csv(str(tmp_path / "docs.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "split").mkdir()  # two jsonl files: read in sorted order, as one stream
    lines = files["jsonl"].read_text().splitlines(keepends=True)
    (tmp_path / "split" / "a.jsonl").write_text("".join(lines[:100]))
    (tmp_path / "split" / "b.jsonl").write_text("".join(lines[100:]))
    ref, _ = build(hf(files))
    hub = []  # what datasets would do about the Hub while it reads the files: nothing, offline
    read_csv = datasets.Dataset.from_csv
    monkeypatch.setattr(datasets.Dataset, "from_csv", lambda *a, **k: hub.append(
        (os.environ.get("HF_HUB_OFFLINE"), datasets.config.HF_HUB_OFFLINE)) or read_csv(*a, **k))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for path in ("docs.parquet", "docs.csv", "saved", "saved_dict", "split"):
        train, _ = build(hf(files, f"data.path={tmp_path / path}"))
        assert train.path != ref.path and np.array_equal(train.tokens.numpy(), ref.tokens.numpy()), path
    assert hub == [("1", True)] and "HF_HUB_OFFLINE" not in os.environ  # (the environment is put back)


GOOD = '{"text": "a"}\n' * 3


def test_bad_input_stops_the_run_before_it_starts_leaving_no_cache(files, tmp_path):
    """The whole path once, through the command line: the second file fails after the first one's tokens were
    written, and neither the run dir nor a cache (not even a partial one) is left."""
    from test_errors import assert_clean_error

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(GOOD)
    (tmp_path / "data" / "b.jsonl").write_text('{"text": "a"}\n\n{"text": null}\n')
    r = run_here(*hf(files, f"data.path={tmp_path / 'data'}", f"data.cache_dir={tmp_path / 'cache'}"),
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, f"{tmp_path / 'data' / 'b.jsonl'} line 3 has no 'text'", "data.text_column")
    assert not (tmp_path / "run").exists() and list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize(("write", "extra", "needles"), [
    (None, ["data.path=/nonexistent/docs.jsonl"], ["data.path='/nonexistent/docs.jsonl'", "does not exist"]),
    ('{"text": "a"}\n{"text": "b"}\n{"text": "c\n', [], ["bad.jsonl line 3 is not valid JSON"]),
    ('{"body": "a"}\n{"body": "b"}\n', [], ["bad.jsonl has no column 'text' (its columns: body)",
                                            "data.text_column"]),
    (None, ["model.vocab_size=256"], ["has 300 tokens, but model.vocab_size=256", "model.vocab_size=300"]),
    # (below 256: the lm task's "the data's 256 byte values, use 256" came first, and 256 was refused next)
    (None, ["model.vocab_size=100"], ["has 300 tokens, but model.vocab_size=100", "model.vocab_size=300"]),
    (None, ["task.sample_tokens=20"], ["task.sample_tokens=20", "decodes its samples as bytes"]),
    (None, ["data.tokenizer=/nonexistent/tokenizer.json"], ["data.tokenizer='/nonexistent/tokenizer.json'"]),
    ("", [], ["bad.jsonl is empty: give data.path files with text in them"]),  # (datasets' SchemaInferenceError)
])
def test_bad_input_is_one_paragraph_naming_the_file_and_line(files, tmp_path, write, extra, needles):
    from trainer.errors import DataError

    if write is not None:
        (tmp_path / "bad.jsonl").write_text(write)
    args = hf(files, *([f"data.path={tmp_path / 'bad.jsonl'}"] if write is not None else []), *extra,
              f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(DataError) as e:
        build(args)
    assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_a_malformed_line_is_said_once_not_logged_by_datasets_first(files, tmp_path, caplog):
    """datasets logged "Failed to load JSON ..." (twice, through Hydra's handler too) before the paragraph."""
    import logging

    from trainer.errors import DataError

    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DataError, match="bad.jsonl line 2 is not valid JSON"):
        build(hf(files, f"data.path={tmp_path / 'bad.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}"))
    assert not [r for r in caplog.records if r.name.startswith("datasets") and r.levelno >= logging.WARNING]
    assert logging.getLogger("datasets").level != logging.CRITICAL  # (put back after)


@pytest.mark.parametrize(("tokenizer", "needle"), [("tokenizer.json", "'tokenizers'"), ("null", "'datasets'")])
def test_without_the_extra_one_paragraph_says_what_to_install(monkeypatch, tmp_path, tokenizer, needle):
    from trainer.errors import DataError

    (tmp_path / "docs.jsonl").write_text(GOOD)
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=rf"needs the {needle} package.*pip install 'trainer\[hf-data\]'"):
        build([*TINY, "data=hf_text", f"data.path={tmp_path / 'docs.jsonl'}", f"data.tokenizer={tokenizer}",
               f"data.cache_dir={tmp_path / 'cache'}"])
    assert not (tmp_path / "cache").exists()
