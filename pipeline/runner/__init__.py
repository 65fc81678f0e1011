"""Tensors: the model, the paged KV cache, attention and sampling."""
