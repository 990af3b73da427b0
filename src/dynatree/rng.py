"""torch's global random generators: one user at a time, and given back as they were.

transformers samples from torch's global generators and initializes new layers from them, so a sampled
`hf-*` decode (api.py), building a draft model or feature head to train (distill/), and sampling
training answers (distill/chat.py) all seed them. Each does it inside `seeded`: it holds `LOCK` (so two
such users on two threads cannot interleave their draws: a sampled hf-* decode on a server thread keeps
its seeded stream while a distillation builds a head on another) and restores the caller's generator
states afterwards (a library call never reseeds its caller's random numbers).
"""

from __future__ import annotations

import contextlib
import threading

import torch

# held by whoever draws from or seeds torch's global generators (reentrant: a sampled hf-* decode started
# from a callback of another on the same thread nests inside it)
LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str | None = None):
    """Hold `LOCK`, seed torch's CPU generator (and `device`'s, when it is a CUDA device) with `seed`,
    and give every touched generator back its state on the way out."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    with LOCK, torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
