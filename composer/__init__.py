"""composer: composable parallelism for training transformer language models."""
