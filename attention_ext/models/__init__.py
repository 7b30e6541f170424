"""Complete models built from attention_ext.nn: the encoder-decoder Transformer and a decoder-only LM."""
from .lm import LanguageModel, LMConfig, sample_next
from .transformer import Transformer, TransformerConfig, TransformerDecoder, TransformerEncoder, load_torch_transformer

__all__ = ["Transformer", "TransformerConfig", "TransformerEncoder", "TransformerDecoder", "load_torch_transformer",
           "LanguageModel", "LMConfig", "sample_next"]
