"""Observability: the metrics line, jsonl and TensorBoard, memory by category,
communication counts, router statistics."""
