"""Speculative decoding: cheap drafts of the next tokens, checked by the model in one forward."""
