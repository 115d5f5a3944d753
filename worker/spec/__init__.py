"""Speculative decoding: proposers that guess the next tokens cheaply, for the target model
to verify in one step (``ngram``: prompt lookup, no weights)."""
