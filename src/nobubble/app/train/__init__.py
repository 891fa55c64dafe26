"""A training run from a ``TrainConfig``: its config and flags, assembly, the emulator's
``Trainer``, checkpoints and metrics."""
