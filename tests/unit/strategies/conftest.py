"""Keep torch on one thread: the machine is shared and these tests are tiny."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
