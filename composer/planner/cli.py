"""``python -m composer.planner`` (``composer-plan``): know before you launch.

    python -m composer.planner --config train_configs/llama3_70b.toml --cluster h100-80gb --nodes 8
    python -m composer.planner --config FILE --cluster h100-80gb --nodes 8 --search \\
        --write-toml plan.toml --svg plan.svg
    python -m composer.planner --config FILE --cluster my_cluster.toml --world-size 16 --json

The job is the same config tree as ``composer.train`` (``--section.key VALUE``
overrides included) and is validated as training validates it. Exit status 0
with the prediction of a valid layout, fitting or not; 2 with one line for bad
input, an invalid layout, or a search where nothing fits.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from composer.config import ConfigError, parse_args
from composer.job.plan import plan_job
from composer.planner.cluster import Cluster, load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.picture import memory_svg
from composer.planner.predict import configured_cluster, label, predict
from composer.planner.report import describe, layout_toml, search_table
from composer.planner.search import search
from composer.torch_compat import untested_torch

log = logging.getLogger("composer")


USAGE = ("composer-plan [--config FILE] [--section.key VALUE ...] [--cluster NAME|FILE]\n"
         "                     [--nodes N | --world-size N] [--search [--top N]]\n"
         "                     [--write-toml FILE] [--svg FILE] [--json]")
EPILOG = """\
The job is composer-train's: --config FILE (a TOML file; default: every key's default)
and --section.key VALUE (or --section.key=VALUE) overrides, validated as training
validates them; composer-train --help lists the sections and their keys. Exit status
0 with the prediction of a valid layout, fitting or not; 2 with one line for bad
input, an invalid layout, or a search where nothing fits.

examples:
  composer-plan --config train_configs/llama3_70b.toml --cluster h100-80gb --nodes 8
  composer-plan --config train_configs/llama3_70b.toml --cluster h100-80gb --nodes 8 \\
      --search --write-toml plan.toml --svg plan.svg
  composer-plan --config train_configs/llama3_8b.toml --cluster h100-80gb --world-size 16 \\
      --parallelism.tensor_parallel_degree 4 --json
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every composer error
        raise ConfigError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="composer-plan", add_help=True, usage=USAGE, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Predict memory, communication and step time of a training "
                            "layout;\n--search ranks every layout that fits.")
    p.add_argument("--cluster", help="a built-in profile or a TOML file (default: the "
                                      "config's planner.cluster, else cpu)")
    p.add_argument("--nodes", type=int,
                   help="nodes of the cluster (world = nodes x devices per node)")
    p.add_argument("--world-size", type=int, help="ranks (default: WORLD_SIZE, else 1)")
    p.add_argument("--search", action="store_true", help="rank every valid layout that fits")
    p.add_argument("--top", type=int, default=10, help="rows of the search table")
    p.add_argument("--write-toml", help="write the best (or the given) layout's config here")
    p.add_argument("--svg", help="draw per-rank memory by category here")
    p.add_argument("--json", action="store_true", help="stdout holds the JSON alone")
    return p


def world_size(args: argparse.Namespace, cluster: Cluster) -> int:
    if args.nodes is not None and args.world_size is not None:
        raise ConfigError("--nodes and --world-size: give one of them")
    for flag, value in (("--nodes", args.nodes), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value}: must be a positive integer")
    if args.nodes is not None:
        return args.nodes * cluster.devices_per_node
    return args.world_size or int(os.environ.get("WORLD_SIZE", "1"))


def _hint(cfg, error: ConfigError) -> str:
    """What moves the same bytes here, for recipes composer refuses."""
    p = cfg.parallelism
    if p.zero_stage == 1 and (p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1):
        return (f"{error}. Megatron's 3D recipes use ZeRO-1 here; zero_stage=2 (FSDP2 without "
                f"resharding) moves the same bytes per step (one gather of the weights, one "
                f"reduce-scatter of the gradients) and also shards the weights at rest")
    return str(error)


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write ({e.strerror})") from None


def _searched(cfg, model, world: int, cluster: Cluster, top: int) -> tuple:
    try:
        found, tried = search(cfg, model, world, cluster)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("searched %d valid layouts of %d ranks: %d fit", tried, world, len(found))
    return found[0], search_table(found, top) + "\n\n" + describe(found[0]), found[:top]


def _predicted(cfg, model, world: int, cluster: Cluster) -> tuple:
    try:
        plan_job(cfg, 0, world)
        layout = layout_of(cfg, model, world, cluster.device)
    except ConfigError as e:
        raise ConfigError(_hint(cfg, e)) from None
    chosen = predict(layout, cluster)
    return chosen, describe(chosen), [chosen]


def run(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    cfg, _ = parse_args(rest)
    if args.cluster is None:
        cluster = configured_cluster(cfg) or load_cluster("cpu")
    else:
        try:
            cluster = load_cluster(args.cluster)
        except ValueError as e:
            raise ConfigError(f"--cluster: {e}") from None
    world = world_size(args, cluster)
    model = load_model(cfg)
    chosen, text, shown = (_searched(cfg, model, world, cluster, args.top) if args.search
                           else _predicted(cfg, model, world, cluster))
    if args.write_toml:
        _write(args.write_toml, layout_toml(chosen))
    if args.svg:
        rows = [(label(p.layout), {k: v for k, v in p.peak.gib().items() if k != "peak"})
                for p in shown]
        _write(args.svg, memory_svg(rows, chosen.capacity_gib,
                                    f"{cfg.model.name}/{cfg.model.flavor} "
                                    f"on {world} x {cluster.name}",
                                    step_s=[p.time.step_s for p in shown]))
    if args.json:
        out = chosen.to_json()
        if args.search:
            out["search"] = [{"layout": label(p.layout), **p.to_json()} for p in shown]
        print(json.dumps(out))
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    untested = untested_torch()
    if untested and not {"-h", "--help"} & set(argv):
        print(untested, file=sys.stderr)
        return 2
    try:
        return run(argv)
    except ValueError as e:  # ConfigError, and the model's own (a cluster without the job's dtype)
        print(f"error: {e}", file=sys.stderr)
        return 2


def cli() -> None:
    sys.exit(main())
