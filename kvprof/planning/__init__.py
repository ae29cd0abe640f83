"""A run's plan before it runs: what it will hold (weights, stored caches, a turn's working set) and how long it
will take, measured on the model's first layers and extrapolated to all of them (`plan`), and the memory this
machine has free (`memory`)."""
