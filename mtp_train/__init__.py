"""mtp_train: train speculative-decoding draft heads (MTP / EAGLE-style) on a frozen target, validate them
with real speculative decoding, and export them in the layouts serving engines load."""

__version__ = "0.1.0"
