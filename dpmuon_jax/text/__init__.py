"""Table-to-text with GPT-2 (paper 2): model, weights, tokenizer, data, decoding, metrics."""
