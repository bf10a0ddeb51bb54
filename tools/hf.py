"""Export a checkpoint to a Hugging Face folder: `python -m tools.hf export CHECKPOINT OUT_DIR` (the mapping is
hf.py's, which train.py's train.init_from=hf:DIR reads through).

    python -m tools.hf export outputs/2026-12-02/10-00-00 my-llama   # the run's newest checkpoint
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('my-llama')"
"""
import argparse
import sys

import hf
from checkpoint import CheckpointError


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a checkpoint (any strategy, any world size) -> a transformers folder")
    ex.add_argument("checkpoint", help="a checkpoint directory (step_<n>), or a run dir: its newest checkpoint")
    ex.add_argument("out", help="the folder to write (must not exist, or be empty)")
    args = ap.parse_args(argv)
    try:
        n, step = hf.export(args.checkpoint, args.out)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}: {n / 1e6:.2f}M parameters, step {step}")


if __name__ == "__main__":
    main()
