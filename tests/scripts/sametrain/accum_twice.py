"""Mistake: loss / accumulation_steps applied twice. Fix: ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(divide=2))
