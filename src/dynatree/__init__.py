"""dynatree: exact tree-based speculative decoding for HuggingFace causal LMs."""

from .api import encode_prompt, generate
from .decode import Decoder
from .errors import DynaTreeError
from .methods import METHODS, make_config
from .models import DEFAULT_TARGET, LoadedModel, load_model
from .tree import Tree, TreeBuilder

__all__ = [
    "DEFAULT_TARGET",
    "METHODS",
    "Decoder",
    "DynaTreeError",
    "LoadedModel",
    "Tree",
    "TreeBuilder",
    "encode_prompt",
    "generate",
    "load_model",
    "make_config",
]
