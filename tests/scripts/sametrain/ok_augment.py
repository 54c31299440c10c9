"""Correct augmentation: each rank seeds seed + rank, so each flips its own way."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(augment=True))
