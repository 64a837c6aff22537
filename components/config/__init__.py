"""The deployment's settings: one validated model read once from stack config.

Pure logic: no resources. Every key is declared once (`models.py`, with `declare.setting`): its default,
bounds, meaning, and the vLLM flag or environment variable it renders to. The owned flags (`flags.py`), the
README's table (`table.py`) and the serving spec's flags are read from those declarations. Every error names
the key path, the bad value and the fix, and all errors are reported together (`loading.py`, `rules.py`).
"""

from components.config.declare import Declared, declarations, setting
from components.config.flags import (
    NEGATABLE_FLAGS,
    OWNED_ENV,
    OWNED_FLAGS,
    VLLM_SHORT_OPTIONS,
    canonical_flag,
)
from components.config.loading import SECRET_KEYS, ConfigError, Loaded, from_stack, parse, read_raw
from components.config.models import (
    LONG_PREFILL_HEADROOM_TOKENS,
    NAMESPACE,
    OPEN_ENDPOINT,
    RECIPE_IMAGE,
    RECIPE_SERVED_NAME,
    Container,
    Gates,
    Node,
    Preflight,
    Serve,
    Settings,
    Ssh,
    Supervisor,
    Watchdog,
    Weights,
)
from components.config.rules import rules

__all__ = [
    "LONG_PREFILL_HEADROOM_TOKENS",
    "NAMESPACE",
    "NEGATABLE_FLAGS",
    "OPEN_ENDPOINT",
    "OWNED_ENV",
    "OWNED_FLAGS",
    "RECIPE_IMAGE",
    "RECIPE_SERVED_NAME",
    "SECRET_KEYS",
    "VLLM_SHORT_OPTIONS",
    "ConfigError",
    "Container",
    "Declared",
    "Gates",
    "Loaded",
    "Node",
    "Preflight",
    "Serve",
    "Settings",
    "Ssh",
    "Supervisor",
    "Watchdog",
    "Weights",
    "canonical_flag",
    "declarations",
    "from_stack",
    "parse",
    "read_raw",
    "rules",
    "setting",
]
