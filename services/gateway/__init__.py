"""Gateway: the public Generate stream, validation, tokenization and detokenization."""
