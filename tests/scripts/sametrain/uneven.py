"""Mistake: uneven local batches (a hand-rolled split of unequal shards) averaged as equal. Fix:
ok_split.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(uneven=True, accumulation=1))
