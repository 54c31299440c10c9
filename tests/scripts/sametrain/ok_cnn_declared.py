"""A CNN whose per-rank BatchNorm is declared deliberate (each rank's statistics on purpose)."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(model="cnn", batchnorm="train", deliberate=("per-rank-batchnorm",)))
