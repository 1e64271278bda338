"""LongStraw: GRPO on million-token prompts: prefill once without autograd, replay branches one at a time."""

__version__ = "0.1.0"
