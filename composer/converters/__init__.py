"""Converters: features that change the model before the passes (float8, LoRA, QLoRA),
each behind the one interface of ``composer.converters.base``.

Imports: torch_compat, spec, config, mesh, models, parallel, checkpoint.
"""
from composer.converters.base import CONVERTERS, Converter, make_converters, register_converter
from composer.converters.float8 import Float8Converter
from composer.converters.lora import LoRAConverter
from composer.converters.qlora import QLoRAConverter

register_converter("float8", Float8Converter)
register_converter("lora", LoRAConverter)
register_converter("qlora", QLoRAConverter)

__all__ = ["CONVERTERS", "Converter", "make_converters", "register_converter"]
