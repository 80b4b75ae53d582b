"""Benchmarks and figures: ShardLab against PyTorch, and slow links (see README.md here)."""
