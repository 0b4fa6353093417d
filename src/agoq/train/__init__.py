"""One rank's training: the Trainer and its loop, the optimizer on fp32 masters, ZeRO-1, checkpoints and metrics."""
