"""The proposers of speculative decoding a worker can run (``worker/spec/``), named as
vLLM names them: ``ngram`` (prompt lookup, no weights), ``draft`` (a smaller model with the
same tokenizer)."""

SPECULATIVE_METHODS = ("ngram", "draft")
