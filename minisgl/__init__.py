"""minisgl: a small LLM serving engine, shaped like the big ones."""

__version__ = "0.1.0"
