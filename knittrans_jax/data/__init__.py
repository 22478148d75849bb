"""Prompt data sets from files (JSONL), for real models and tokenizers."""
from knittrans_jax.data.prompts import Prompt, PromptDataError, PromptSet, load_prompts

__all__ = ["Prompt", "PromptDataError", "PromptSet", "load_prompts"]
