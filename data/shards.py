"""Token shards on disk, and batches drawn from them.

A shard is a 64-byte header of eight little-endian int64s (magic, version, bytes per token, token count, the rest 0)
followed by the tokens as uint16 (vocab <= 65536) or uint32. It is read back through np.memmap, so a corpus far
bigger than memory costs nothing to open.

A batch is a pure function of (seed, split, step): every rank draws the same global batch of step k and takes its
own contiguous slice. Any parallel layout therefore sees exactly the same data per optimizer step, and resuming
needs nothing but the step number.
"""
import os

import numpy as np
import torch

MAGIC, VERSION, HEADER_BYTES = 20261130, 1, 64
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size, requested="auto"):
    """The shard dtype for a vocab: the smallest that holds every id, or the requested one if it does."""
    if requested == "auto":
        requested = "uint16" if vocab_size <= 2**16 else "uint32"
    if requested not in DTYPES:
        raise ValueError(f"data.token_dtype={requested!r}: expected auto, uint16 or uint32")
    if vocab_size > np.iinfo(DTYPES[requested]).max + 1:
        raise ValueError(f"a vocab of {vocab_size} tokens does not fit in data.token_dtype={requested} "
                         f"(at most {np.iinfo(DTYPES[requested]).max + 1}); use uint32 or auto")
    return DTYPES[requested]


class ShardWriter:
    """Append token arrays to a shard; the count in the header is filled in on close."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self.f = open(path, "wb")
        self.f.write(b"\0" * HEADER_BYTES)

    def write(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.size and tokens.max() > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {tokens.max()} does not fit in {self.dtype}")
        self.f.write(tokens.astype(self.dtype).tobytes())
        self.count += tokens.size

    def close(self):
        self.f.seek(0)
        self.f.write(np.array([MAGIC, VERSION, self.dtype.itemsize, self.count, 0, 0, 0, 0], "<i8").tobytes())
        self.f.close()


def write_shard(path, tokens, dtype):
    w = ShardWriter(path, dtype)
    w.write(tokens)
    w.close()


def read_shard(path):
    header = np.fromfile(path, dtype="<i8", count=8)
    if len(header) < 8 or header[0] != MAGIC:
        raise ValueError(f"{path} is not a token shard (bad magic)")
    if header[1] != VERSION:
        raise ValueError(f"{path}: shard version {header[1]}, this code reads {VERSION}")
    dtype = {2: np.uint16, 4: np.uint32}[int(header[2])]
    count = int(header[3])
    if os.path.getsize(path) != HEADER_BYTES + count * np.dtype(dtype).itemsize:
        raise ValueError(f"{path} is truncated: header says {count} tokens")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


SPLIT_IDS = {"train": 0, "val": 1}


def get_batch(tokens, split, seed, step, batch_size, seq_len, rank=0, world=1):
    """Rank `rank`'s slice (batch_size/world sequences) of the global batch of `step`, as (inputs, targets)."""
    rng = np.random.default_rng([seed, SPLIT_IDS[split], step])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)  # the whole global batch, on every rank
    n = batch_size // world
    rows = np.stack([tokens[s: s + seq_len + 1] for s in starts[rank * n: (rank + 1) * n]]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]
