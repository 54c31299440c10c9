"""Mistake: a CNN whose BatchNorm normalises per rank (no SyncBatchNorm).
Fix: ok_cnn_frozen_bn.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(model="cnn", batchnorm="train"))
