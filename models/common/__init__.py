"""The decoder pieces every family here shares: RMSNorm (``norm``), rotary
embeddings (``rotary``), the document masks (``mask``), the attention core and
module (``attention``), weight initialisation (``init``), the SwiGLU
feed-forward and the pre-norm block (``block``) and the decoder around them
(``decoder``).

Llama, Qwen3 and the MoE family build on these, so a change here changes all
of them; each family keeps only what is its own (arguments, flavors, costs,
its Hugging Face layout). The module names (``attention.wq``,
``feed_forward.w1``, ``layers.N``...) are the state-dict keys that checkpoints,
the Hugging Face adapters and the tensor-parallel plans read. Nothing here
knows about distribution.
"""
from __future__ import annotations

from composer.models.common.args import DecoderArgs
from composer.models.common.attention import Attention, CausalAttention
from composer.models.common.block import FeedForward, TransformerBlock
from composer.models.common.decoder import Transformer
from composer.models.common.init import residual_std, trunc_normal_
from composer.models.common.mask import DocumentMask, additive_mask, document_mask
from composer.models.common.norm import RMSNorm, compute_dtype
from composer.models.common.rotary import RopeScaling, apply_rotary, rope_inv_freq, rope_tables

__all__ = ["Attention", "CausalAttention", "DecoderArgs", "DocumentMask", "FeedForward",
           "RMSNorm", "RopeScaling", "Transformer", "TransformerBlock", "additive_mask",
           "apply_rotary", "compute_dtype", "document_mask", "residual_std", "rope_inv_freq",
           "rope_tables", "trunc_normal_"]
