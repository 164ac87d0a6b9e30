"""HMI: a hierarchical multi-tenant inference server for pretrained language models."""

__version__ = "0.1.0"
