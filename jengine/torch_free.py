"""Keeping torch out of the processes jengine owns.

Where it sits: the `jengine` command (`entrypoints/cli.py`) and the engine process's spawn
target (`engine/client.py`) call `keep_torch_out()` first thing. Neither process needs
torch (tokenizers come from the `tokenizers` library, weights through safetensors and
jengine's GGUF reader), but transformers 5 imports torch whenever it is installed, ~2 s of
every process start on 2 cores, and has no switch to stop it.

Promises: torch is then absent as on an install without it (`import torch` raises
ImportError, transformers reports it unavailable); a process that already imported torch
(a user's `__main__` that the engine process re-imports under `spawn`) keeps it.
"""

import sys


def keep_torch_out() -> None:
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
