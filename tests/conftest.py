import os

import torch

# The Triton kernels run under the interpreter on machines without a GPU; the flag must be set
# before any @triton.jit function is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
