"""Models that fail from the inside, each in one named place: ``examples/my_model.py``'s
decoder, tiny, with ``blocks.1.mlp`` swapped for an MLP that raises. Named as
``--model.name tests.support.failing_models:<spec>``:

- ``in_forward``: the MLP's forward raises RuntimeError;
- ``in_backward``: its output goes through an autograd Function whose backward raises;
- ``colwise_norm``: the tensor-parallel plan shards ``norm_out`` column-wise, which
  torch's pass refuses (NotImplementedError) while it builds the model with tp 2;
- ``in_init``: the MLP cannot draw its weights (RuntimeError) while the model is built;
- ``in_constructor``: the MLP's constructor raises while the job is checked;
- ``returns_tuple``: the forward returns (logits, an auxiliary loss), not its logits.
"""
from __future__ import annotations

import dataclasses

import torch

from composer import ModelSpec
from examples.my_model import MLP, TP_PLAN, MyArgs, MyModel, spec

TINY = MyArgs(vocab_size=512, dim=16, n_heads=2, n_layers=2, hidden=32, max_seq_len=64,
              tied=False)  # untied: pipeline stages may hold the embedding and the head apart


class RaisingMLP(MLP):
    def forward(self, x):
        raise RuntimeError("the MLP refuses this batch\nsecond line, in the log only")


class NoGradient(torch.autograd.Function):
    """The identity, whose backward raises."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no gradient for this MLP")


class NoGradientMLP(MLP):
    def forward(self, x):
        return NoGradient.apply(super().forward(x))


class UndrawableMLP(MLP):
    def init_weights(self):
        raise RuntimeError("cannot draw this MLP's weights")


class UnbuildableMLP(MLP):
    def __init__(self, a: MyArgs):
        super().__init__(a)
        raise RuntimeError("this MLP cannot be built")


class ReturnsTuple(MyModel):
    def forward(self, tokens, documents=None, positions=None):
        logits = super().forward(tokens, documents, positions)
        return logits, logits.new_zeros(())


class DelegatingModel(MyModel):
    """Each MLP draws its own weights where it has an ``init_weights``."""

    def init_weights(self):
        super().init_weights()
        for block in self.blocks.values():
            if hasattr(block.mlp, "init_weights"):
                block.mlp.init_weights()


def _with_mlp(mlp: type[MLP], model: type[MyModel] = MyModel):
    def build(a: MyArgs) -> MyModel:
        m = model(a)
        m.blocks["1"].mlp = mlp(a)
        return m
    return build


def _spec(name: str, build, tp_plan=TP_PLAN) -> ModelSpec:
    return dataclasses.replace(spec, name=name, flavors={"tiny": TINY}, build=build,
                               tp_plan=tp_plan)


in_forward = _spec("in_forward", _with_mlp(RaisingMLP))
in_backward = _spec("in_backward", _with_mlp(NoGradientMLP))
colwise_norm = _spec("colwise_norm", MyModel, {**TP_PLAN, "norm_out": "colwise"})
in_init = _spec("in_init", _with_mlp(UndrawableMLP, DelegatingModel))
in_constructor = _spec("in_constructor", _with_mlp(UnbuildableMLP))
returns_tuple = _spec("returns_tuple", ReturnsTuple)
