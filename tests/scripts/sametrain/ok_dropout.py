"""Correct dropout: the model is built alike on every rank, then each rank seeds seed + rank."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(dropout=0.2))
