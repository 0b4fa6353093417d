"""Session-wide test setup."""

import os

import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which must be chosen before
# anything imports triton (torch.compile in the 8-bit AdamW tests does): kernels bind to the
# interpreter when they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
