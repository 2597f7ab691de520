"""Benchmarks and baselines: speed against PyTorch and the machine's peak, and a naive-Bayes accuracy baseline."""
