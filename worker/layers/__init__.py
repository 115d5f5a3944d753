"""Building blocks of the decoder models, written tensor-parallel-ready."""
