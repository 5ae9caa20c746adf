"""The unannotated MiniGPT of the seed article, and what it needs to train."""

from minigpt_model.model import MiniGPT

__all__ = ["MiniGPT"]
