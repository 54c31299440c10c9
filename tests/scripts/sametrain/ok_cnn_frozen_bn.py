"""A correct CNN with BatchNorm, fine-tuned with its BatchNorm frozen (eval mode: running
statistics, the same on every rank). On GPUs, SyncBatchNorm is the other fix
(nn.SyncBatchNorm.convert_sync_batchnorm; torch runs it on GPUs only)."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(model="cnn"))
