"""The planner: predicts the memory, communication and time of a training layout
on a cluster profile, and searches layouts (``python -m composer.planner``).

    from composer.planner import load_cluster, layout_of, load_model, predict
    cfg, _ = composer.config.parse_args(["--config", "train_configs/llama3_70b.toml"])
    p = predict(layout_of(cfg, load_model(cfg), 64, "cuda"), load_cluster("h100-80gb"))
    p.to_json()  # memory_gib, comm, step_s, tokens_per_second, mfu, comm_share, fits

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults, inference, job, observe, trainer.
"""
from composer.planner.cluster import CLUSTERS, Cluster, load_cluster
from composer.planner.layout import Layout, layout_of, load_model
from composer.planner.predict import Prediction, predict
from composer.planner.search import search

__all__ = ["CLUSTERS", "Cluster", "Layout", "Prediction", "layout_of", "load_cluster",
           "load_model", "predict", "search"]
