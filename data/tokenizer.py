"""Tokenizers, both used as `tiktoken.Encoding`s.

- gpt2: tiktoken's GPT-2 encoding. It needs its BPE files: online, or from `TIKTOKEN_CACHE_DIR`.
- bpe:  a byte-level BPE trained on the corpus itself with rustbpe (as nanochat does), so the default run needs
        nothing from the network. It is stored as a text rank file (`base64(token bytes) rank` per line, the format
        tiktoken reads with `load_tiktoken_bpe`) plus a small JSON with the split pattern. Never a pickle: loading a
        tokenizer must not run code.
"""
import base64
import json
import os

import tiktoken

EOT = "<|endoftext|>"


def gpt2():
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline without a cache: requests/urllib errors of several kinds
        raise RuntimeError(
            "the gpt2 tokenizer needs tiktoken's BPE files: go online once, or set TIKTOKEN_CACHE_DIR to a folder "
            f"holding them (this repo's tests use ../shared/tiktoken_cache) [{type(e).__name__}]") from None


def train_bpe(texts, vocab_size):
    """Train a byte-level BPE of `vocab_size` tokens (the last one is EOT) on an iterator of strings."""
    import rustbpe
    if not 257 < vocab_size:
        raise ValueError(f"data.vocab_size={vocab_size}: a byte-level BPE needs more than 257 tokens (256 bytes + EOT)")
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts, vocab_size - 1)
    ranks = {bytes(b): r for b, r in tok.get_mergeable_ranks()}
    return ranks, tok.get_pattern()


def save_bpe(path, ranks, pattern):
    """Write `<path>.tiktoken` (ranks) and `<path>.json` (pattern, special tokens)."""
    with open(path + ".tiktoken", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    with open(path + ".json", "w") as f:
        json.dump({"pattern": pattern, "special_tokens": {EOT: len(ranks)}}, f)


def load_bpe(path):
    return from_spec(spec(path))


def spec(path):
    """A tokenizer as one JSON object, for checkpoints and exported models: "gpt2" by name (path "gpt2"), a trained
    BPE (path: its files without extension) in full, ranks and all."""
    if path == "gpt2":
        return {"kind": "gpt2"}
    with open(path + ".tiktoken") as f:
        ranks = f.read()
    with open(path + ".json") as f:
        return {"kind": "bpe", "name": os.path.basename(path), "ranks": ranks, **json.load(f)}


def from_spec(s):
    """The tiktoken Encoding of a spec()."""
    if s["kind"] == "gpt2":
        return gpt2()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in s["ranks"].splitlines()
                                                                    if line)}
    return tiktoken.Encoding(name=s["name"], pat_str=s["pattern"], mergeable_ranks=ranks,
                             special_tokens=s["special_tokens"])


def eot_id(enc):
    return enc.encode_single_token(EOT)
