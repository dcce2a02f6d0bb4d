"""The fused decoder: which architectures it takes, its lean forward, the weight matrices it multiplies, and the
re-laid linear layers of models it cannot take."""
