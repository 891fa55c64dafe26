import torch

# Tiny test models run fastest on one intra-op thread, and one thread per test process keeps
# OpenMP from spinning against other processes on this 2-core machine.
torch.set_num_threads(1)
