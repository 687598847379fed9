"""Loading: the `Model` handle (config, params, tokenizer, compiled programs, placement), known
models fetched and converted once (`hub`), and the deltas a shipped model applies at load."""
