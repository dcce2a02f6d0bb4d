"""Paged attention: the KV pool and its layouts, the attention function transformers calls, the GPU kernel by token
table, and the probe that checks a model's attention keywords before it is paged."""
