"""Attention backends: the interface (base.py), one module per backend, and the choice
between them (registry.py).

Their `--attn` names are listed here too, apart from the classes, so that the command line
and the engine's config can be checked in the API server's process, which never imports
torch; registry.py checks that its classes carry exactly these names.
"""

NAMES = (  # best first, as registry.BACKENDS
    "fi",  # [ch19]
    "triton",  # [ch20]
    "fa",  # [ch20]
    "torch",
)
