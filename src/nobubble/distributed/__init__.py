"""Layer 2: the multi-process runtime on torch.distributed (gloo on CPU, NCCL on CUDA)."""
