import os

import torch

# Triton reads TRITON_INTERPRET when it is imported (torch._dynamo imports it) and when each
# @triton.jit kernel is defined, so the CPU kernel tests need it set here, before any test
# module is collected. Only without CUDA: on a GPU machine the kernels must compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
