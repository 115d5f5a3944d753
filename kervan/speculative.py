"""The proposers of speculative decoding a worker can run (``worker/spec/``), named as
vLLM names them: ``ngram`` (prompt lookup, no weights), ``draft`` (a smaller model with the
same tokenizer), ``eagle`` (a one-layer head on the target's hidden states)."""

SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
