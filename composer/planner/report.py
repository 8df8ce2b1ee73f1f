"""The planner's words: a prediction as text, the ZeRO formula it rests on, the
search's table, and the TOML of a chosen layout."""
from __future__ import annotations

import copy

from composer.config import JobConfig, to_toml
from composer.planner.memory import CATEGORIES, GIB
from composer.planner.predict import Prediction, label
from composer.planner.search import why_slower
from composer.planner.state import rank_state, state_bytes

KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
        "broadcast": "BC", "send": "SEND", "recv": "RECV"}


def state_formula(p: Prediction) -> str:
    """Model state per rank as composer's ZeRO formula for N data-parallel ranks."""
    layout = p.layout
    e = layout.storage_bytes
    zero, n = layout.cfg.parallelism.zero_stage, layout.dims.dp_shard * layout.dims.cp
    state = rank_state(layout, layout.stages()[0])
    rest = state_bytes(layout, state)
    total = (rest.params + rest.grads + rest.optimizer) / GIB
    weights, moments = f"{e}P + {e}P", f"{2 * e}P"
    if state.total("trainable_rest") < state.total("rest"):  # LoRA, QLoRA: a frozen base
        return (f"model state per rank: the frozen base as stored ({rest.params / GIB:.2f} GiB) + "
                f"the trainable parameters' gradients and AdamW moments "
                f"({(rest.grads + rest.optimizer) / GIB:.3f} GiB): {total:.2f} GiB")
    if not layout.dims.dp_enabled:
        text = f"{weights} + {moments} = {4 * e}P (no data parallel)"
    elif zero == 0:
        text = f"{weights} + {moments} = {4 * e}P (DDP: replicated)"
    elif zero == 1:
        text = f"{weights} + {moments}/N = {2 * e}P + {2 * e}P/N (ZeRO-1: optimizer state sharded)"
    elif zero == 2:
        text = (f"({weights} + {moments})/N = {4 * e}P/N at rest, + the gathered weights from "
                f"forward to backward (composer's stage 2 is FSDP2 without resharding: it shards "
                f"parameters at rest, unlike DeepSpeed's ZeRO-2, which keeps them whole)")
    else:
        text = f"({weights} + {moments})/N = {4 * e}P/N (ZeRO-3)"
    return (f"model state per rank: {text}; "
            f"P = {p.layout.model.spec.num_params(layout.model.args):,} "
            f"parameters here (TP/PP/EP cut first), N = {n}: {total:.2f} GiB")


def comm_lines(p: Prediction) -> list[str]:
    per_dim: dict[str, dict] = {}
    for dims in p.comm.values():
        for dim, kinds in dims.items():
            entry = per_dim.setdefault(dim, {})
            for kind, c in kinds.items():
                e = entry.setdefault(kind, [0, 0.0])
                e[0] += c["count"]
                e[1] += c["ring_bytes"]
    lines = []
    for dim, kinds in sorted(per_dim.items()):
        parts = "  ".join(f"{KIND[k]} {n} ({b / GIB:.3g} GiB)"
                          for k, (n, b) in sorted(kinds.items()))
        lines.append(f"  {dim:12s} {parts}   {p.time.by_dim.get(dim, 0):.3g} s")
    return lines or ["  none (one rank)"]


def describe(p: Prediction) -> str:
    layout, t, c = p.layout, p.time, p.cluster
    m = p.peak.gib()
    nodes = -(-layout.dims.world_size // c.devices_per_node)
    mem = " | ".join(f"{k} {m[k]:.2f}" for k in CATEGORIES)
    lines = [
        f"{layout.cfg.model.name}/{layout.cfg.model.flavor} on {layout.dims.world_size} x "
        f"{c.name} ({nodes} node(s) of {c.devices_per_node}): {label(layout)}",
        f"memory per rank, GiB, at its peak ({p.peak.peak.name}"
        + (f", pipeline rank {p.ranks.index(p.peak)}" if len(p.ranks) > 1 else "") + "):",
        f"  {mem} | peak {m['peak']:.2f} of {p.capacity_gib:.2f} usable: "
        + ("fits" if p.fits else "DOES NOT FIT"),
        f"  {state_formula(p)}",
        *([f"  the skewest routing (every choice of the ep group on one rank's experts) adds "
           f"{p.peak.skew / GIB:.2f} GiB; the peak above assumes balanced routing"]
          if p.peak.skew else []),
        "communication per step (ring bytes per rank, time on its link):", *comm_lines(p),
        f"step {t.step_s:.4g} s: compute {t.compute_s:.4g} s (at {t.efficiency:.0%} of peak), "
        f"exposed communication {t.exposed_comm_s:.4g} s of {t.comm_s:.4g} s, "
        f"pipeline bubble {t.bubble:.1%}",
        f"tokens/s per device {t.tokens_per_second:,.0f}, MFU "
        + (f"{t.mfu:.1%}" if t.mfu is not None else "n/a")
        + f", communication share {t.comm_share:.1%}",
    ]
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def search_table(found: list[Prediction], top: int) -> str:
    best = found[0]
    rows = [f"{'#':>3}  {'layout':52s} {'peak GiB':>9} {'step s':>9} {'tok/s/dev':>10} "
            f"{'MFU':>6} {'comm':>6}  why it loses to #1"]
    for i, p in enumerate(found[:top], 1):
        t = p.time
        reason = "" if p is best else why_slower(p, best)
        mfu = f"{t.mfu:.1%}" if t.mfu is not None else "n/a"
        rows.append(f"{i:>3}  {label(p.layout):52s} {p.peak.gib()['peak']:9.2f} {t.step_s:9.4g} "
                    f"{t.tokens_per_second:10,.0f} {mfu:>6} {t.comm_share:6.1%}  {reason}")
    return "\n".join(rows)


def layout_toml(p: Prediction) -> str:
    """The chosen layout's config: what ``composer.train --validate`` accepts."""
    cfg: JobConfig = copy.deepcopy(p.layout.cfg)
    return (f"# written by composer.planner: {label(p.layout)} on {p.layout.dims.world_size} x "
            f"{p.cluster.name}\n# predicted: {p.peak.gib()['peak']:.2f} GiB per rank, "
            f"{p.time.tokens_per_second:,.0f} tokens/s per device\n" + to_toml(cfg))
