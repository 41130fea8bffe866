"""Template builds on a node (docs/DESIGN.md §8): layers.py (cache keys, the layer store), builder.py (the
builder VM and the steps; its docstring says why a build restores and never boots), http.py (the node's
build endpoint, which the API streams through)."""
