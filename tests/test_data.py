import os
import shutil

import numpy as np
import pytest
import torch

from conftest import SHARED, make_cfg, needs_shared
from data import prepare, shards, tokenizer

pytestmark = pytest.mark.quick  # the quick tier: all of this file is fast, in this process


@pytest.mark.parametrize("dtype,top", [(np.uint16, 65535), (np.uint32, 2**20)])
def test_shard_round_trip(tmp_path, dtype, top):
    tokens = np.random.default_rng(0).integers(0, top + 1, size=10_001)
    path = str(tmp_path / "s.bin")
    shards.write_shard(path, tokens, dtype)
    back = shards.read_shard(path)
    assert back.dtype == dtype and len(back) == len(tokens)
    np.testing.assert_array_equal(back, tokens)
    header = np.fromfile(path, dtype="<i8", count=8)
    assert list(header[:4]) == [shards.MAGIC, shards.VERSION, np.dtype(dtype).itemsize, len(tokens)]


def test_shard_errors(tmp_path):
    path = str(tmp_path / "s.bin")
    shards.write_shard(path, np.arange(100), np.uint16)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    with pytest.raises(ValueError, match="truncated"):
        shards.read_shard(path)
    (tmp_path / "junk.bin").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="magic"):
        shards.read_shard(str(tmp_path / "junk.bin"))
    with pytest.raises(ValueError, match="does not fit"):
        shards.write_shard(path, np.array([70000]), np.uint16)


def test_token_dtype():
    assert shards.token_dtype(50257) == np.uint16
    assert shards.token_dtype(65536) == np.uint16
    assert shards.token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="does not fit"):
        shards.token_dtype(100_000, "uint16")


def test_bpe_round_trip_and_text_format(tmp_path):
    text = open(prepare.__file__).read()
    ranks, pattern = tokenizer.train_bpe(iter([text] * 3), 400)
    path = str(tmp_path / "bpe")
    tokenizer.save_bpe(path, ranks, pattern)
    lines = open(path + ".tiktoken").read().splitlines()  # plain text: "base64 rank" per line, no pickle
    assert len(lines) == 399 and lines[65].split() == ["QQ==", "65"]  # byte 'A'
    enc = tokenizer.load_bpe(path)
    assert enc.n_vocab == 400 and tokenizer.eot_id(enc) == 399
    sample = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    ids = enc.encode_ordinary(sample)
    assert enc.decode(ids) == sample
    assert len(ids) < len(sample.encode())  # merges were learned


@needs_shared("tiktoken_cache")
def test_gpt2_round_trip(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken_cache"))
    enc = tokenizer.gpt2()
    assert enc.n_vocab == 50257 and tokenizer.eot_id(enc) == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.decode(enc.encode_ordinary("To be, or not to be")) == "To be, or not to be"


def test_gpt2_offline_without_cache_is_a_clear_error(monkeypatch, tmp_path):
    import tiktoken.registry
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: tiktoken would have to download
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    import tiktoken.load

    def no_network(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    with pytest.raises(RuntimeError, match="TIKTOKEN_CACHE_DIR"):
        tokenizer.gpt2()


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    x1, y1 = shards.get_batch(tokens, "train", 7, 3, 8, 16)
    x2, y2 = shards.get_batch(tokens, "train", 7, 3, 8, 16)
    torch.testing.assert_close(x1, x2)
    assert not torch.equal(x1, shards.get_batch(tokens, "train", 7, 4, 8, 16)[0])  # another step, other data
    assert not torch.equal(x1, shards.get_batch(tokens, "train", 8, 3, 8, 16)[0])  # another seed
    torch.testing.assert_close(y1[:, :-1], x1[:, 1:])  # targets are inputs shifted by one
    for world in (2, 4):  # the ranks' slices, in rank order, are exactly the global batch
        parts = [shards.get_batch(tokens, "train", 7, 3, 8, 16, rank, world) for rank in range(world)]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x1)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y1)


def test_prepare_caches_and_joins_documents_with_eot(tmp_path):
    docs = [f"document number {i} " + "word " * (i % 7 + 1) for i in range(300)]
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("\n\n".join(docs[i * 100:(i + 1) * 100]))
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/*.txt]", "data.vocab_size=300", "data.num_proc=2")
    cache = str(tmp_path / "cache")
    folder = prepare.prepare(cfg.data, cache, log=lambda *a: None)
    train, val, enc, meta = prepare.load(folder)
    assert meta["documents"] == 300 and meta["tokens"] == len(train) + len(val)
    eot = tokenizer.eot_id(enc)
    all_tokens = np.concatenate([train, val])
    assert (all_tokens == eot).sum() == 300 and all_tokens[-1] == eot
    texts = sorted(enc.decode(list(map(int, d))) for d in np.split(all_tokens, np.where(all_tokens == eot)[0] + 1)[:-1]
                   if len(d))
    assert sorted(t + "<|endoftext|>" for t in docs) == sorted(texts) or \
        sorted(docs) == sorted(t.replace("<|endoftext|>", "") for t in texts)
    assert 0.03 < len(val) / meta["tokens"] < 0.07  # val_fraction 0.05
    mtime = os.path.getmtime(os.path.join(folder, "train.bin"))
    assert prepare.prepare(cfg.data, cache, log=lambda *a: None) == folder  # cached: nothing rewritten
    assert os.path.getmtime(os.path.join(folder, "train.bin")) == mtime
    assert not [p for p in os.listdir(cache) if ".tmp" in p]
    (tmp_path / "f0.txt").write_text("changed " * 50)  # a changed source prepares again
    assert prepare.prepare(cfg.data, cache, log=lambda *a: None) != folder


def test_cache_key_is_the_contents_not_the_place(tmp_path):
    """A cache is found from another checkout or machine (tools/gpu_bench.py's bundle): the key holds each file's
    size and bytes, not its path, name or mtime; a changed byte, even at the same size, is another cache."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "corpus.txt").write_text("To be, or not to be\n\nthat is the question")
    shutil.copy(tmp_path / "a" / "corpus.txt", tmp_path / "b" / "renamed.txt")
    os.utime(tmp_path / "b" / "renamed.txt", (1e9, 1e9))
    found = [prepare.cache_path(make_cfg("data=text", f"data.paths=[{tmp_path}/{f}]").data, "~/c")
           for f in ("a/corpus.txt", "b/renamed.txt")]
    assert found[0] == found[1]
    (tmp_path / "b" / "renamed.txt").write_text("To be, or not to be\n\nthat is the Question")
    assert prepare.cache_path(make_cfg("data=text", f"data.paths=[{tmp_path}/b/renamed.txt]").data, "~/c") != found[0]


def test_pycode_source_is_the_stdlib():
    cfg = make_cfg()
    files = prepare.local_files(cfg.data)
    assert len(files) > 300 and all(f.endswith(".py") for f in files)
    assert not any(os.sep + "site-packages" + os.sep in f or os.sep + "test" + os.sep in f for f in files)
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in files)


def test_json_source_reads_text_field(tmp_path):
    import json
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"id": i, "body": f"entry {i} says hello " * 3}) + "\n")
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/d.jsonl]", "data.text_field=body", "data.vocab_size=300")
    train, val, enc, meta = prepare.load(prepare.prepare(cfg.data, str(tmp_path / "c"), log=lambda *a: None))
    assert meta["documents"] == 200 and "says hello" in enc.decode(list(map(int, train[:50])))
