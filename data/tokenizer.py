"""Tokenizers, both used as `tiktoken.Encoding`s.

- gpt2: tiktoken's GPT-2 encoding. It needs its BPE files: online, or from `TIKTOKEN_CACHE_DIR`.
- bpe:  a byte-level BPE trained on the corpus itself with rustbpe (as nanochat does), so the default run needs
        nothing from the network. It is stored as a text rank file (`base64(token bytes) rank` per line, the format
        tiktoken reads with `load_tiktoken_bpe`) plus a small JSON with the split pattern. Never a pickle: loading a
        tokenizer must not run code.
- hf:   a Hugging Face model's own tokenizer (its folder's tokenizer.json, read by the `tokenizers` library), behind
        the few methods of tiktoken's Encoding that the data pipeline and sampling call (`HFTokenizer`). Its
        end-of-text token is the folder's eos token (tokenizer_config.json, else config.json's eos_token_id).
"""
import base64
import json
import os

import tiktoken

EOT = "<|endoftext|>"


HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what an export copies back


class HFTokenizer:
    """A `tokenizers.Tokenizer` answering as tiktoken's Encoding does where this repo calls it."""

    def __init__(self, tokenizer_json, eot):
        from tokenizers import Tokenizer
        self.tok, self.eot = Tokenizer.from_str(tokenizer_json), eot
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)

    def encode_ordinary(self, text):  # ordinary: no BOS/EOS added, as tiktoken's encode_ordinary adds none
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


class TokenizerError(ValueError):
    """Tokenizer files that can't be used."""


def hf_spec(folder):
    """An HF tokenizer folder as a spec: its files' text and the end-of-text id. TokenizerError in one line."""
    from tokenizers import Tokenizer
    files = {}
    for name in HF_FILES:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                files[name] = f.read()
    if "tokenizer.json" not in files:
        raise TokenizerError(f"data.tokenizer=hf: {folder} has no tokenizer.json")
    tok = Tokenizer.from_str(files["tokenizer.json"])
    eos = json.loads(files.get("tokenizer_config.json", "{}")).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos  # older files store an AddedToken's fields
    eot = tok.token_to_id(eos) if eos else None
    if eot is None and os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            eot = json.load(f).get("eos_token_id")
        eot = eot[0] if isinstance(eot, list) else eot
    if eot is None:
        raise TokenizerError(f"data.tokenizer=hf: {folder} names no end-of-text token (tokenizer_config.json's "
                             f"eos_token, or config.json's eos_token_id): documents need one between them")
    return {"kind": "hf", "name": os.path.basename(os.path.normpath(folder)), "files": files, "eot": int(eot)}


def hf_vocab_size(folder):
    from tokenizers import Tokenizer
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        raise TokenizerError(f"data.tokenizer=hf: {folder} has no tokenizer.json")
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size(with_added_tokens=True)


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
    """The tiktoken Encoding (or HFTokenizer) of a spec()."""
    if s["kind"] == "gpt2":
        return gpt2()
    if s["kind"] == "hf":
        return HFTokenizer(s["files"]["tokenizer.json"], s["eot"])
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in s["ranks"].splitlines()
                                                                    if line)}
    return tiktoken.Encoding(name=s["name"], pat_str=s["pattern"], mergeable_ranks=ranks,
                             special_tokens=s["special_tokens"])


def eot_id(enc):
    return enc.eot if isinstance(enc, HFTokenizer) else enc.encode_single_token(EOT)


def eot_of_spec(s):
    """The end-of-text id of a spec(), without building the tokenizer."""
    return {"gpt2": lambda: 50256, "bpe": lambda: s["special_tokens"][EOT], "hf": lambda: s["eot"]}[s["kind"]]()
