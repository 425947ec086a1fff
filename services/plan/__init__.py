"""``crescent plan``: weights, cache and concurrency of a hybrid model on a GPU shape (docs/k3.md)."""
