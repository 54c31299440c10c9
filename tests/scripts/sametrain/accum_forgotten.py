"""Mistake: loss / accumulation_steps forgotten. Fix: ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(divide=0))
