"""Corpus -> tokenizer -> train/val token shards, prepared once and cached.

Sources (conf/data/*.yaml):
- pycode:      the Python standard library's own .py files (tests left out): on every machine that has Python.
- text:        local files, `data.paths=[file or glob, ...]`; .txt/.md/.py as text, .json/.jsonl, .parquet.
- fineweb_edu: streamed from the Hugging Face hub (online only), the first `data.max_docs` documents.

Text is read through HF `datasets`, tokenized with tiktoken in a batched `.map` over `num_proc` processes, documents
are shuffled (fixed seed) and joined with EOT after each, and the stream's last `val_fraction` becomes the val shard.
The cache key is a hash of the sources' contents (each file's size and sha256, in order; no paths or times) and every
setting that changes the tokens, so a change to either prepares again, a rerun costs nothing, and a cache prepared in
one checkout or machine is found from another (tools/gpu_bench.py carries one to a GPU machine without `datasets`).
Reading a prepared cache (prepare's early return, load) needs numpy and tiktoken, never `datasets`. Everything is
written to a temporary folder and renamed into place only when complete: an interrupted prepare never leaves a
half-written cache behind.
"""
import glob
import hashlib
import json
import os
import shutil
import socket
import sysconfig
import time

import numpy as np

from data import shards, tokenizer

CACHE_VERSION = 2  # 2: the key holds the files' contents, not their paths and mtimes
GPT2_VOCAB = 50257
BUILDERS = {".txt": "text", ".md": "text", ".py": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Bad data settings or input; train.py turns it into a one-line error."""


def vocab_size(dcfg):
    if dcfg.tokenizer == "hf":  # the HF tokenizer's own size, added tokens included
        try:
            return tokenizer.hf_vocab_size(hf_folder(dcfg))
        except tokenizer.TokenizerError as e:
            raise DataError(str(e)) from None
    return GPT2_VOCAB if dcfg.tokenizer == "gpt2" else int(dcfg.vocab_size)


def hf_folder(dcfg):
    if not dcfg.get("tokenizer_dir"):
        raise DataError("data.tokenizer=hf reads a Hugging Face tokenizer.json: set data.tokenizer_dir=DIR, or "
                        "train.init_from=hf:DIR (its own tokenizer)")
    return os.path.expanduser(dcfg.tokenizer_dir)


def local_files(dcfg):
    """The files of a local source, checked before any work: every pattern matches, the corpus is not empty."""
    if dcfg.source == "pycode":
        root = sysconfig.get_paths()["stdlib"]
        skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"}  # encodings: codec tables
        files = []
        for folder, dirs, names in os.walk(root):  # not into the skipped folders: site-packages alone holds torch, and
            dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]  # globbing it all took 0.7 s
            files += [os.path.join(folder, n) for n in names if n.endswith(".py") and not n.startswith(".")]
        files.sort()
        if not files:
            raise DataError(f"data=pycode: no .py files under the standard library at {root}")
    else:
        if not dcfg.paths:
            raise DataError("data=text needs data.paths=[file or glob, ...]")
        files = []
        for pattern in dcfg.paths:
            found = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
            if not found:
                raise DataError(f"data.paths: {pattern!r} matches no file")
            files += found
        exts = {os.path.splitext(f)[1] for f in files}
        unknown = exts - BUILDERS.keys()
        if unknown:
            raise DataError(f"data.paths: can't read {sorted(unknown)} files; known: {sorted(BUILDERS)}")
        if len({BUILDERS[e] for e in exts}) > 1:
            raise DataError(f"data.paths mixes formats {sorted(exts)}; give one kind of file per run")
    if sum(os.path.getsize(f) for f in files) == 0:
        raise DataError(f"empty corpus: the {len(files)} file(s) of data={dcfg.source} hold no bytes")
    return files


def file_digest(path, chunk=1 << 20):
    """sha256 of a file's bytes, read in chunks: a corpus need not fit in memory (about 1 s per GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_key(dcfg, files):
    # the files by content alone: a path or an mtime differs between checkouts and machines (a copied file gets a
    # new mtime), and would hide a cache that holds exactly these tokens
    what = {"v": CACHE_VERSION, "source": dcfg.source, "tokenizer": dcfg.tokenizer, "vocab": vocab_size(dcfg),
            "val_fraction": dcfg.val_fraction, "dtype": dcfg.token_dtype, "sample_by": dcfg.sample_by,
            "text_field": dcfg.text_field, "max_docs": dcfg.get("max_docs"), "hub": dcfg.get("hub_name"),
            "files": [(os.path.getsize(f), file_digest(f)) for f in files or []]}
    if dcfg.tokenizer == "hf":  # the tokenizer by content too
        what["hf_tokenizer"] = file_digest(os.path.join(hf_folder(dcfg), "tokenizer.json"))
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def prepare(dcfg, cache_dir, log=print):
    """Return the cache folder holding train.bin, val.bin, meta.json (and the bpe tokenizer), preparing it once."""
    files = None if dcfg.source == "fineweb_edu" else local_files(dcfg)
    dtype = shards.token_dtype(vocab_size(dcfg), dcfg.token_dtype)
    out = cache_path(dcfg, cache_dir, files)
    if os.path.exists(os.path.join(out, "meta.json")):
        return out
    tmp = f"{out}.tmp-{socket.gethostname()}-{os.getpid()}"  # two nodes over one shared cache may share a pid
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        t0 = time.time()
        docs = hub_docs(dcfg) if files is None else local_docs(dcfg, files, os.path.join(tmp, "hf"))
        log(f"data: {len(docs):,} documents from data={dcfg.source}, tokenizing with {dcfg.tokenizer}")
        if dcfg.tokenizer == "bpe":
            t1 = time.time()
            ranks, pattern = tokenizer.train_bpe(text_stream(docs, dcfg.bpe_train_chars), vocab_size(dcfg))
            tokenizer.save_bpe(os.path.join(tmp, "bpe"), ranks, pattern)
            log(f"data: trained a {vocab_size(dcfg)}-token BPE in {time.time() - t1:.1f}s")
        if dcfg.tokenizer == "hf":  # the folder's files, kept in the cache: checkpoints and exports carry them
            try:
                with open(os.path.join(tmp, "hf.json"), "w") as f:
                    json.dump(tokenizer.hf_spec(hf_folder(dcfg)), f)
            except tokenizer.TokenizerError as e:
                raise DataError(str(e)) from None
        spec = {"bpe": os.path.join(tmp, "bpe"), "gpt2": "gpt2", "hf": "hf:" + os.path.join(tmp, "hf.json")}[
            dcfg.tokenizer]
        docs = docs.shuffle(seed=0).map(encode_batch, batched=True, batch_size=256, fn_kwargs={"spec": spec},
                                        num_proc=max(1, min(dcfg.num_proc or os.cpu_count(), len(docs) // 256)),
                                        remove_columns=docs.column_names, desc="tokenizing")
        count = write_split(docs, dtype, tmp, dcfg.val_fraction)
        shutil.rmtree(os.path.join(tmp, "hf"), ignore_errors=True)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"tokenizer": dcfg.tokenizer, "vocab_size": vocab_size(dcfg), "tokens": count,
                       "documents": len(docs), "files": len(files or [])}, f)
        try:
            os.replace(tmp, out)  # atomic: a reader sees no folder or a complete one
        except OSError:  # another process (another node's, over a shared cache) finished first: its copy is ours
            if not os.path.exists(os.path.join(out, "meta.json")):
                raise
            shutil.rmtree(tmp)
        log(f"data: {count:,} tokens written to {out} in {time.time() - t0:.1f}s")
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cache_path(dcfg, cache_dir, files=None):
    """The cache folder of this data config (its key: the settings and the files' contents)."""
    files = files if files is not None or dcfg.source == "fineweb_edu" else local_files(dcfg)
    return os.path.join(os.path.expanduser(cache_dir), f"{dcfg.source}-{dcfg.tokenizer}-{cache_key(dcfg, files)}")


def wait_for(dcfg, cache_dir, log=print, poll_s=1.0):
    """The cache folder, once another process on this machine (its local rank 0) has prepared it: polled on the file
    system, not waited for in a collective, whose timeout (NCCL's 10 minutes) a long tokenization would pass. If
    that process fails, torchrun stops this one."""
    out, start, said = cache_path(dcfg, cache_dir), time.time(), 0
    while not os.path.exists(os.path.join(out, "meta.json")):
        if time.time() - start > 60 * (said + 1):
            said += 1
            log(f"data: waiting for local rank 0 to prepare {out} ({said} min)")
        time.sleep(poll_s)
    return out


def local_docs(dcfg, files, hf_cache):
    import datasets
    datasets.disable_progress_bars() if os.environ.get("CI") else None
    builder = BUILDERS[os.path.splitext(files[0])[1]]
    kw = {"sample_by": dcfg.sample_by} if builder == "text" else {}
    ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache, **kw)
    if dcfg.text_field not in ds.column_names:
        raise DataError(f"data.text_field={dcfg.text_field!r} is not a column of {files[0]} (has {ds.column_names})")
    return ds.select_columns([dcfg.text_field]).rename_column(dcfg.text_field, "text") \
        if dcfg.text_field != "text" else ds.select_columns(["text"])


def hub_docs(dcfg):
    """The first max_docs documents of a hub dataset, streamed (no full download) into a map-style dataset."""
    import datasets
    try:
        stream = datasets.load_dataset(dcfg.hub_name, name=dcfg.hub_subset, split="train", streaming=True)
        rows = [r[dcfg.text_field] for _, r in zip(range(dcfg.max_docs), stream)]
    except Exception as e:
        raise DataError(f"data=fineweb_edu streams {dcfg.hub_name} from the Hugging Face hub and could not reach it "
                        f"({type(e).__name__}); offline, use data=pycode or data=text") from None
    return datasets.Dataset.from_dict({"text": rows})


def text_stream(docs, max_chars):
    """The documents' text, up to max_chars in all: enough to learn merges without reading a huge corpus twice."""
    seen = 0
    for batch in docs.iter(batch_size=256):
        for text in batch["text"]:
            yield text
            seen += len(text)
            if seen >= max_chars:
                return


_encoders = {}


def encode_batch(batch, spec):
    # load once per worker process; the spec ("gpt2", a BPE's path, "hf:" an HF spec's path) pickles where an
    # Encoding need not
    if spec not in _encoders:
        _encoders[spec] = tokenizer.gpt2() if spec == "gpt2" else tokenizer.from_spec(json.load(open(spec[3:]))) \
            if spec.startswith("hf:") else tokenizer.load_bpe(spec)
    enc = _encoders[spec]
    eot = tokenizer.eot_id(enc)
    return {"ids": [ids + [eot] for ids in enc.encode_ordinary_batch(batch["text"])]}


def write_split(docs, dtype, out, val_fraction):
    """Stream all documents into one shard, then split it: its last val_fraction of tokens becomes val.bin."""
    w = shards.ShardWriter(os.path.join(out, "all.bin"), dtype)
    for batch in docs.iter(batch_size=1024):
        w.write(np.concatenate([np.asarray(ids) for ids in batch["ids"]]))
    w.close()
    tokens = shards.read_shard(w.path)
    n_val = max(1, int(len(tokens) * val_fraction))
    shards.write_shard(os.path.join(out, "train.bin"), tokens[:-n_val], dtype)
    shards.write_shard(os.path.join(out, "val.bin"), tokens[-n_val:], dtype)
    del tokens
    os.remove(w.path)
    return w.count


def tokenizer_spec(folder, meta):
    if meta["tokenizer"] == "hf":
        with open(os.path.join(folder, "hf.json")) as f:
            return json.load(f)
    return tokenizer.spec("gpt2" if meta["tokenizer"] == "gpt2" else os.path.join(folder, "bpe"))


def load(folder):
    """(train tokens, val tokens, tokenizer Encoding, meta) of a prepared cache folder."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    enc = tokenizer.from_spec(tokenizer_spec(folder, meta))
    return shards.read_shard(os.path.join(folder, "train.bin")), shards.read_shard(os.path.join(folder, "val.bin")), \
        enc, meta
