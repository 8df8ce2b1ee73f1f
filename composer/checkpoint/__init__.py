"""Checkpoints: DCP steps (atomic, resumable, loadable on any layout) and the
generic safetensors I/O of Hugging Face folders (the names come from each model's
adapter).

Imports: torch_compat, spec, config, mesh, parallel.
"""
