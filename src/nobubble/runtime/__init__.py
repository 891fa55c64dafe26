"""The runtimes that drive the engine: the in-process emulator and torch.distributed."""
