"""swinbench: where a Swin Transformer's GPU time goes, and how to make it faster, stage by stage."""

__version__ = "0.1.0"
