"""Inference: a trained model answering prompts (``decode``: a KV cache around the
attention cores, greedy or sampled decoding) and lm-eval's view of it (``lm_eval``,
the ``eval`` extra).

Imports: torch_compat, spec, config, mesh, models, parallel, checkpoint, converters.
"""
