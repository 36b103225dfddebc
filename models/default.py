"""Where the bundled default model lives (used by `jengine serve` / `jengine generate`
when no model is given)."""

import os

DEFAULT_MODEL_PATH = os.path.join(os.path.dirname(__file__), "shakespeare-llama")
