"""The torch.distributed runtime (gloo on CPU, NCCL on CUDA): transport, staging, clocks, the
rank runner of ``Pipeline(runtime="dist")``, data parallelism and sharding within a stage."""
