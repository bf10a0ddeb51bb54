"""Generate text from an exported model (one safetensors file; `python -m checkpoint CHECKPOINT OUT`),
on one process, whatever strategy and world size trained it.

    python -m checkpoint outputs/2026-11-30/12-00-00 model.safetensors   # the run's newest checkpoint
    python sample.py model.safetensors --prompt "def " --tokens 200
"""
import argparse
import json
import sys

import torch

from data import tokenizer
from model import GPT, GPTConfig


def load(path, device="cpu"):
    """(model, tiktoken Encoding, metadata) of an exported model."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {})["nanoparallel"])
        weights = load_file(path, device=device)
    except (OSError, SafetensorError, KeyError, ValueError) as e:
        raise ValueError(f"{path} is not a model exported by `python -m checkpoint` "
                         f"({type(e).__name__}: {e})") from None
    with torch.device("meta"):
        model = GPT(GPTConfig(**meta["model"]))
    if model.cfg.tie_embeddings:  # the file holds the one weight once, as wte.weight; the head is that weight
        weights["head.weight"] = weights.get("wte.weight")
    biases = {k: weights.pop(k) for k in list(weights) if k.endswith(".expert_bias")}  # router=bias: buffers
    model.load_state_dict(weights, assign=True)  # every parameter, exactly: a missing or extra one is an error
    model.init_buffers(device)  # the RoPE tables, and the tie again (assign=True gave the head its own Parameter)
    for k, v in biases.items():
        model.get_submodule(k.rsplit(".", 1)[0]).expert_bias.copy_(v)
    return model.eval(), tokenizer.from_spec(meta["tokenizer"]), meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .safetensors file written by python -m checkpoint")
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top_k", type=int, default=50, help="0: sample from the whole vocabulary")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.samples < 1 or args.temperature <= 0 or args.top_k < 0:
        sys.exit("error: --tokens and --samples must be at least 1, --temperature above 0, --top_k 0 or more")
    try:
        model, enc, meta = load(args.model, args.device)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, trained "
          f"{meta['step']} steps")
    torch.manual_seed(args.seed)
    prompt = enc.encode_ordinary(args.prompt) or [tokenizer.eot_id(enc)]
    idx = torch.tensor([prompt] * args.samples, device=args.device)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k)
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i} ---\n{enc.decode(row)}")


if __name__ == "__main__":
    main()
