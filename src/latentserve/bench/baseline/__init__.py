"""What the benchmark suites build and time against: random-weight checkpoints of each family
(``*_models``) and the eager per-request reference loops (``*_reference``)."""
