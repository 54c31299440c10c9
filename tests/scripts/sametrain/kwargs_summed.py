"""Mistake: an HF-shaped model whose loss, computed inside, is a sum. Fix: ok_kwargs.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(model="kwargs", reduction="sum"))
